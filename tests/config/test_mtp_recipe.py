"""model.mtp_num_layers (multi-token prediction): loaded strictly, passed to megatron-core, built.

The keys load, round-trip and reach the TransformerConfig; bad values fail naming the key; the
recipe is refused on CPU (megatron-core's MTP loss tracker allocates on the GPU). The model the
train job builds from it has the MTP layers and, with a CCE loss, computes every depth's loss in
the CCE layer: one step of it gives the gradients of the same model with megatron's own loss.
"""

import math

import pytest
import torch

from cce_parallel.config import RecipeError, diff_from_defaults, dump_recipe, load_recipe, recipe_from_dict


def test_mtp_keys_load_and_round_trip():
    recipe = load_recipe(None, ["model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3"])
    assert recipe.model.mtp_num_layers == 2 and recipe.model.mtp_loss_scaling_factor == 0.3
    assert diff_from_defaults(recipe)["model"] == {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}
    assert recipe_from_dict(__import__("yaml").safe_load(dump_recipe(recipe))) == recipe
    assert load_recipe(None).model.mtp_num_layers is None  # off by default
    assert recipe.check_world(2, "cuda") == load_recipe(None).check_world(2, "cuda")  # fine on CUDA


@pytest.mark.parametrize(
    "model, key",
    [
        ({"mtp_num_layers": 0}, "model.mtp_num_layers: must be > 0"),
        ({"mtp_num_layers": -1}, "model.mtp_num_layers: must be > 0"),
        ({"mtp_num_layers": "2"}, "model.mtp_num_layers: expected an int"),
        ({"mtp_num_layers": 1.5}, "model.mtp_num_layers: expected an int"),
        ({"mtp_num_layers": True}, "model.mtp_num_layers: expected an int"),
        ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": -0.1}, "model.mtp_loss_scaling_factor: must be a finite"),
        ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": math.inf}, "model.mtp_loss_scaling_factor: must be a finite"),
        ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": "high"}, "model.mtp_loss_scaling_factor: expected a number"),
        ({"mtp_loss_scaling_factor": 0.3}, "model.mtp_loss_scaling_factor: only applies with model.mtp_num_layers"),
    ],
)
def test_bad_mtp_values_name_the_key(model, key):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"model": model})
    assert str(info.value).startswith(key), str(info.value)


def test_mtp_needs_cuda():
    recipe = recipe_from_dict({"model": {"mtp_num_layers": 1}})
    with pytest.raises(RecipeError, match=r"^model.mtp_num_layers: 1 \(multi-token prediction\) needs CUDA"):
        recipe.check_world(2, "cpu")


def test_mtp_reaches_megatron_and_the_estimates():
    pytest.importorskip("megatron.core")
    from cce_parallel.train.estimate import dry_run
    from cce_parallel.train.gpt import flops_per_token, transformer_config

    plain = load_recipe(None)
    mtp = load_recipe(None, ["model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.2"])
    config = transformer_config(mtp, dtype=torch.float32, cpu_init=True)
    assert config.mtp_num_layers == 2 and config.mtp_loss_scaling_factor == 0.2
    assert transformer_config(plain, dtype=torch.float32, cpu_init=True).mtp_num_layers is None
    m, vocab = plain.model, 1024
    h = m.hidden_size
    layer = 4 * h * h + 2 * h * m.ffn_size  # attention + MLP weights of one GeLU layer
    extra = 6.0 * 2 * (layer + 2 * h * h + vocab * h) + 12.0 * 2 * m.seq_length * h
    assert flops_per_token(mtp, vocab) == pytest.approx(flops_per_token(plain, vocab) + extra)
    # --dry-run builds the last stage with its MTP layers (the meta device; no GPU).
    with_mtp, without = dry_run(mtp, world_size=2, quiet=True), dry_run(plain, world_size=2, quiet=True)
    assert with_mtp["params_total"] > without["params_total"]
    assert with_mtp["stages"][-1]["output_layer"] == "CCEOutputLayer"


def _step(recipe, batch, loss_mask):
    """The train job's model for `recipe` (seed 0), one forward/backward of the masked mean loss
    with the MTP losses attached: (main loss [b, s] × mask, logged MTP losses, grads by name)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from cce_parallel.train.gpt import build_gpt, model_vocab_size, transformer_config

    torch.manual_seed(0)
    config = transformer_config(recipe, dtype=torch.float32, cpu_init=True)
    model = build_gpt(recipe, config, vocab_size=model_vocab_size(recipe, 256), device="cpu", loss_scale=1.0)
    # megatron-core's MTP tracker allocates on torch.cuda.current_device() unless its buffers exist.
    n = recipe.model.mtp_num_layers
    tracker = MTPLossLoggingHelper.tracker
    tracker.clear()
    for key in ("values", "loss_values", "correct_values", "total_values"):
        tracker[key] = torch.zeros(n)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=loss_mask)
        ((loss * loss_mask).sum() / loss_mask.sum()).backward()
        # megatron-core 0.19 logs into loss_values (with acceptance counts), 0.16 into values.
        newer = hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")
        logged = tracker["loss_values" if newer else "values"].clone()
    finally:
        tracker.clear()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return model, (loss * loss_mask).detach(), logged, grads


@pytest.mark.interpreter
def test_a_training_step_with_mtp_matches_megatrons_loss():
    """The recipe's model (TP 1, fp32, CPU) with model.mtp_num_layers=2: CCE's losses and every
    gradient are those of the same model with loss.impl=megatron."""
    pytest.importorskip("megatron.core")
    from tests.dist import one_megatron_rank
    from tests.megatron.gpt_setup import rel_err

    overrides = ["model.mtp_num_layers=2", "parallel.tensor=1", "model.seq_length=16", "model.hidden_size=32"]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(16).expand(2, -1)}
    loss_mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    with one_megatron_rank():
        cce_model, cce_loss, cce_mtp, cce_grads = _step(load_recipe(None, overrides), batch, loss_mask)
        _, ref_loss, ref_mtp, ref_grads = _step(load_recipe(None, [*overrides, "loss.impl=megatron"]), batch, loss_mask)
    layer = cce_model.output_layer
    assert type(layer).__name__ == "CCEOutputLayer" and sorted(layer.mtp_cce_states) == [1, 2]
    assert len(cce_model.mtp.layers) == 2
    assert all(s.paths.get("one_pass") == 1 for s in layer.mtp_cce_states.values()), repr(layer)
    assert rel_err(cce_loss, ref_loss) <= 1e-6 and rel_err(cce_mtp, ref_mtp) <= 1e-6
    assert sorted(cce_grads) == sorted(ref_grads)
    assert any(name.startswith("mtp.") for name in cce_grads)
    worst = max(cce_grads, key=lambda name: rel_err(cce_grads[name], ref_grads[name]))
    assert rel_err(cce_grads[worst], ref_grads[worst]) <= 1e-6, worst
