"""Activation recomputation (model.recompute_*) changes memory, not the math: the train job's
GPTModel gives the same losses and gradients with and without it, on CPU (one gloo rank).

The model is built by cce_parallel.train.gpt from a recipe, as the train job builds it, and
each test checks that recomputation really ran (megatron's checkpoint function was called), so
that a recipe key that silently did nothing would fail.

megatron-core's CheckpointFunction saves and restores the CUDA RNG state around the recomputed
forward (``torch.cuda.get_rng_state``, which needs CUDA), so the train job rejects recomputation
on CPU (Recipe.check_world). The CPU test replaces those two calls by no-ops: the model has no
dropout, so no random numbers are drawn and the RNG state does not matter; everything else
(the checkpointed forward, the recompute in the backward) is megatron's own code.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import tensor_parallel  # noqa: E402

from cce_parallel.config import recipe_from_dict  # noqa: E402
from tests.dist import one_megatron_rank  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module")
def one_rank():
    with one_megatron_rank():
        yield


def _loss_and_grads(model_keys: dict, loss_impl: str, monkeypatch):
    from cce_parallel.train.gpt import build_gpt, transformer_config

    recipe = recipe_from_dict({
        "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                  "attention": "sdpa", "activation": "swiglu", "add_bias_linear": False,
                  "normalization": "RMSNorm", **model_keys},
        "loss": {"impl": loss_impl},
        "parallel": {"tensor": 1},
    })
    calls = {"n": 0}
    original = tensor_parallel.random.CheckpointFunction.apply

    def counting(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(tensor_parallel.random.CheckpointFunction, "apply", counting)
    # CUDA RNG state save/restore: nothing to save on CPU without dropout (see the module docstring).
    monkeypatch.setattr(tensor_parallel.random, "_get_cuda_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(tensor_parallel.random, "_set_cuda_rng_state", lambda *a, **k: None)
    torch.manual_seed(0)
    config = transformer_config(recipe, dtype=torch.float32, cpu_init=True)
    model = build_gpt(recipe, config, vocab_size=VOCAB, device="cpu")
    model.train()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 16), generator=gen)
    position_ids = torch.arange(16).expand(2, 16)
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, calls["n"]


@pytest.mark.parametrize("loss_impl", ["cce_kahan_full_c", "megatron"])
@pytest.mark.parametrize(
    "keys, checkpoints",
    [
        ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, 4),
        ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}, 2),
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3}, 3),
        ({"recompute_granularity": "selective", "recompute_modules": "core_attn"}, 4),
    ],
    ids=["full-uniform-1", "full-uniform-2", "full-block-3", "selective-core_attn"],
)
def test_recompute_gives_the_same_loss_and_gradients(one_rank, monkeypatch, loss_impl, keys, checkpoints):
    ref_loss, ref_grads, ref_calls = _loss_and_grads({}, loss_impl, monkeypatch)
    loss, grads, calls = _loss_and_grads(keys, loss_impl, monkeypatch)
    assert ref_calls == 0
    assert calls == checkpoints  # megatron's CheckpointFunction ran, once per chunk/layer
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _decoder_input(model_keys: dict):
    from cce_parallel.train.gpt import build_gpt, transformer_config

    recipe = recipe_from_dict({"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                                         "seq_length": 16, "attention": "sdpa", **model_keys},
                               "parallel": {"tensor": 1}})
    torch.manual_seed(0)
    model = build_gpt(recipe, transformer_config(recipe, dtype=torch.float32, cpu_init=True), vocab_size=VOCAB,
                      device="cpu")
    seen = {}

    def keep(module, args, kwargs):
        seen["hidden"] = kwargs["hidden_states"].detach().clone()

    model.decoder.register_forward_pre_hook(keep, with_kwargs=True)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
    loss.backward()
    return seen["hidden"], model.embedding.word_embeddings.weight.grad


def test_scale_embeddings_multiplies_the_decoder_input_by_sqrt_hidden(one_rank):
    """model.scale_embeddings (Gemma): the decoder sees the embeddings times sqrt(32); gradients flow."""
    plain, _ = _decoder_input({})
    scaled, grad = _decoder_input({"scale_embeddings": True})
    torch.testing.assert_close(scaled, plain * 32**0.5, rtol=1e-6, atol=0)
    assert grad is not None and grad.abs().sum() > 0


def test_rope_scaling_factor_gives_llama3_frequencies(one_rank):
    """model.rope_scaling_factor: the rotary frequencies of Llama 3.1/3.2 (computed here from their
    definition: long wavelengths divided by the factor, short ones kept, a smooth ramp between)."""
    from cce_parallel.train.gpt import build_gpt, transformer_config

    def inv_freq(factor):
        keys = {"rope_scaling_factor": factor} if factor else {}
        recipe = recipe_from_dict({"model": {"num_layers": 1, "hidden_size": 256, "num_attention_heads": 2,
                                             "seq_length": 16, "attention": "sdpa", "position_embedding": "rope",
                                             "rotary_base": 500000, **keys}, "parallel": {"tensor": 1}})
        model = build_gpt(recipe, transformer_config(recipe, dtype=torch.float32, cpu_init=True),
                          vocab_size=VOCAB, device="cpu")
        return model.rotary_pos_emb.inv_freq

    plain, scaled = inv_freq(None), inv_freq(32.0)
    torch.testing.assert_close(plain, 1.0 / 500000 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    expected = []
    for f in plain.tolist():
        wavelength = 2 * torch.pi / f
        if wavelength < 8192 / 4:
            expected.append(f)
        elif wavelength > 8192 / 1:
            expected.append(f / 32)
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            expected.append((1 - smooth) * f / 32 + smooth * f)
    torch.testing.assert_close(scaled, torch.tensor(expected), rtol=1e-5, atol=0)
    assert (scaled < plain).any() and (scaled == plain).any()


@pytest.mark.gpu
@pytest.mark.parametrize("keys", [
    ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"],
    ["model.recompute_granularity=selective", "model.recompute_modules=core_attn"],
], ids=["full", "selective"])
def test_gpu_train_job_with_recompute_matches(tiny_data, runs_dir, keys):
    """On a GPU, with dropout (so that megatron's checkpoint must restore the CUDA RNG state for the
    recomputed forward): 20 steps of the train job with recomputation give the losses of the run
    without it. Run: ``CCE_TEST_GPU=1 pytest tests/e2e/test_recompute.py -k gpu`` (one GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cce_parallel.train.metrics import read_metrics
    from tests.e2e.conftest import base_overrides, run_train, train_env

    env = train_env()
    env.pop("TRITON_INTERPRET")
    common = ["run.device=cuda", "parallel.tensor=1", "train.precision=fp32", "train.steps=20", "logging.interval=1",
              "logging.wandb=disabled", "eval.interval=1000", "checkpoint.interval=1000", "model.num_layers=4",
              "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "model.attention=sdpa"]
    name = "recompute-" + keys[0].split("=")[1]
    run_train(base_overrides(runs_dir, tiny_data, "no-recompute-" + name) + common, nproc=1, env=env)
    run_train(base_overrides(runs_dir, tiny_data, name) + common + keys, nproc=1, env=env)
    want = read_metrics(runs_dir / ("no-recompute-" + name) / "metrics.jsonl")["train"]
    got = read_metrics(runs_dir / name / "metrics.jsonl")["train"]
    assert sorted(got) == sorted(want) == list(range(1, 21))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
