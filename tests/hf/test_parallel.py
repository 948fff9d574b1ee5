"""HF in and out at TP 2 and PP 2 (two gloo ranks): ``model.init_from``'s loader reads each rank's
shards from a saved transformers directory (safetensors slices), our step-0 loss and logits equal
transformers' (fp32), and the ranks' shards merge back into the very same HF weights (the export's
merge). One spawned group runs every case: GPT-2, Llama and Gemma 2 at TP 2, Llama at PP 2 (tied,
so the last stage's output layer is loaded from the embedding)."""

import traceback

import pytest
import torch

from tests.dist import spawn
from tests.hf import tiny

pytestmark = pytest.mark.distributed

CASES = [("gpt2", 2, 1, {}), ("llama", 2, 1, {"tie_embeddings": True}), ("gemma2", 2, 1, {}),
         ("llama", 1, 2, {"tie_embeddings": True})]


def _case(rank, arch, tp, pp, model_keys, hf_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cce_parallel.config import recipe_from_dict
    from cce_parallel.hf.convert import hf_state
    from cce_parallel.hf.load import load_hf
    from cce_parallel.train.gpt import build_gpt, transformer_config

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    recipe = recipe_from_dict(tiny.recipe_dict(arch, tp=tp, pp=pp, **model_keys))
    model = build_gpt(recipe, transformer_config(recipe, dtype=torch.float32, cpu_init=True),
                      vocab_size=tiny.VOCAB, device="cpu").eval()
    load_hf(model, recipe, f"hf:{hf_dir}", tokenizer_vocab=tiny.VOCAB)
    tokens, labels = tiny.batch()
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    result = {}
    with torch.no_grad():
        if pp == 1:
            loss = model(tokens, position_ids, None, labels=labels).mean()
            logits = model(tokens, position_ids, None)  # [b, s, V/tp]
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits)
            result = {"loss": loss.item(), "logits": torch.cat(parts, dim=-1)}
        else:  # stage 0 -> stage 1, by hand (megatron's schedules need CUDA)
            stage = parallel_state.get_pipeline_model_parallel_rank()
            model.set_input_tensor(None)
            if stage == 0:
                hidden = model(tokens, position_ids, None)  # [s, b, h]
                dist.send(hidden.contiguous(), dst=1)
            else:
                hidden = torch.empty(tokens.shape[1], tokens.shape[0], recipe.model.hidden_size)
                dist.recv(hidden, src=0)
                model.set_input_tensor(hidden)
                result = {"loss": model(tokens, position_ids, None, labels=labels).mean().item()}
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, ((parallel_state.get_tensor_model_parallel_rank(),
                                     parallel_state.get_pipeline_model_parallel_rank()), model.state_dict()))
    if rank == 0:
        result["hf_state"] = hf_state(recipe, dict(states), vocab=tiny.VOCAB, hf_vocab=tiny.VOCAB)
    return result


def _worker(rank, world_size, report, hf_dirs):
    from tests.megatron.gpt_setup import install_cpu_shims

    install_cpu_shims()  # a tied embedding across stages is all-reduced through .cuda()
    for arch, tp, pp, keys in CASES:
        name = f"{arch}-tp{tp}-pp{pp}"
        report.started(name)
        try:
            report.result(name, _case(rank, arch, tp, pp, keys, hf_dirs[name]))
        except Exception:  # noqa: BLE001 - reported to the parent
            report.result(name, {"error": traceback.format_exc()})


@pytest.mark.interpreter
def test_tp2_and_pp2_load_and_merge(tmp_path):
    hf_dirs, refs = {}, {}
    tokens, labels = tiny.batch()
    for arch, tp, pp, keys in CASES:
        name = f"{arch}-tp{tp}-pp{pp}"
        hf = tiny.hf_model(arch, **keys)
        hf.save_pretrained(tmp_path / name)
        hf_dirs[name] = str(tmp_path / name)
        refs[name] = (hf, *tiny.hf_logits_and_loss(hf, tokens, labels))
    outcome = spawn(_worker, 2, (hf_dirs,), timeout=400.0)
    assert outcome.ok, outcome.describe()
    for arch, tp, pp, _ in CASES:
        name = f"{arch}-tp{tp}-pp{pp}"
        hf, ref_logits, ref_loss = refs[name]
        results = [outcome.results(r)[name] for r in range(2)]
        for r in results:
            assert "error" not in r, r.get("error")
        last = results[-1]  # the last pipeline stage has the loss
        assert abs(last["loss"] - ref_loss.item()) < 1e-4 * ref_loss.item(), (name, last["loss"], ref_loss.item())
        if "logits" in results[0]:
            logits = results[0]["logits"]
            cap = tiny.LOSS_SOFTCAP.get(arch)
            logits = cap * torch.tanh(logits / cap) if cap else logits
            assert tiny.rel(logits, ref_logits) < 1e-4, name
        original = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        back = results[0]["hf_state"]
        assert sorted(back) == sorted(original), name
        for key, value in original.items():
            assert torch.equal(back[key], value), (name, key)
