"""Recipes: every shipped recipe validates and dry-runs; broken recipes fail naming the key."""

import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch

from cce_parallel.config import (
    CCE_IMPLS,
    LOSS_IMPLS,
    Recipe,
    RecipeError,
    apply_override,
    diff_from_defaults,
    dump_recipe,
    load_recipe,
    recipe_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
SHIPPED = {"tiny", "gpt2-small-owt", "llama-1b-owt", "gemma-2b-owt", "llama3-8b-owt"}
WORLD = {"llama3-8b-owt": 8}  # test_dry_run's world size where its layout needs more than 4 ranks


def test_shipped_recipes_exist():
    assert SHIPPED <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_round_trips(path):
    recipe = load_recipe(path)
    assert recipe.run.name == path.stem
    assert load_recipe_text(dump_recipe(recipe), path.parent) == recipe


def load_recipe_text(text, tmp_dir):
    return recipe_from_dict(__import__("yaml").safe_load(text))


def test_tiny_is_the_default():
    assert load_recipe(ROOT / "recipes" / "tiny.yaml") == Recipe()
    assert load_recipe(None) == Recipe()
    assert diff_from_defaults(Recipe()) == {}


def test_owt_recipes_use_the_paper_pretraining_mode():
    for name, vocab in (("gpt2-small-owt", 50257), ("llama-1b-owt", 128256), ("gemma-2b-owt", 256000),
                        ("llama3-8b-owt", 128256)):
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        assert recipe.loss.impl == "cce_kahan_full_c"
        assert recipe.model.vocab_size == vocab
        assert recipe.data.source == "openwebtext"
        offline = load_recipe(ROOT / "recipes" / f"{name}.yaml", ["data.source=stdlib", "data.tokenizer=bpe"])
        assert offline.data.tokenizer == "bpe"
        # megatron's loss has no softcap: Gemma's comparison run drops it (the recipe header says so).
        megatron = ["loss.impl=megatron"] + (["loss.softcap=null"] if recipe.loss.softcap else [])
        assert load_recipe(ROOT / "recipes" / f"{name}.yaml", megatron).loss.impl == "megatron"


def test_llama_recipe_is_llama_3_2_1b():
    m = load_recipe(ROOT / "recipes" / "llama-1b-owt.yaml").model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim, m.ffn_size) == (
        16, 2048, 32, 8, 64, 8192)
    assert (m.activation, m.normalization, m.layernorm_epsilon, m.position_embedding, m.rotary_base,
            m.rope_scaling_factor) == ("swiglu", "RMSNorm", 1e-5, "rope", 500000, 32.0)
    assert m.tie_embeddings and not m.scale_embeddings and not m.add_bias_linear


def test_llama3_8b_recipe_is_llama_3_1_8b():
    """Llama 3.1 8B's config.json: sizes, RoPE (θ 500,000, llama3 scaling with factor 8 over an
    original 8,192 positions, low/high frequency factors 1 and 4), RMSNorm, SwiGLU, no biases,
    untied; the vocabulary needs no padding at TP 8 (or TP 4)."""
    from cce_parallel.hf.convert import architecture, hf_config
    from cce_parallel.train.gpt import model_vocab_size

    recipe = load_recipe(ROOT / "recipes" / "llama3-8b-owt.yaml")
    m = recipe.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim, m.ffn_size) == (
        32, 4096, 32, 8, 128, 14336)
    assert (m.activation, m.normalization, m.layernorm_epsilon, m.position_embedding, m.rotary_base,
            m.rope_scaling_factor) == ("swiglu", "RMSNorm", 1e-5, "rope", 500000, 8.0)
    assert not m.tie_embeddings and not m.scale_embeddings and not m.add_bias_linear and not m.gemma2_options
    assert (m.vocab_size, m.seq_length, recipe.loss.impl, recipe.parallel.tensor) == (
        128256, 8192, "cce_kahan_full_c", 8)
    assert recipe.data.tokenizer == "hf:meta-llama/Llama-3.1-8B"
    config = hf_config(recipe, m.vocab_size)
    assert architecture(recipe) == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}
    assert (config["max_position_embeddings"], config["tie_word_embeddings"]) == (131072, False)
    for tp in (8, 4):
        padded = load_recipe(ROOT / "recipes" / "llama3-8b-owt.yaml", [f"parallel.tensor={tp}"])
        assert model_vocab_size(padded, 128256) == 128256


def test_gemma_recipe_is_gemma_2_2b():
    m = load_recipe(ROOT / "recipes" / "gemma-2b-owt.yaml").model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim, m.ffn_size) == (
        26, 2304, 8, 4, 256, 9216)
    assert (m.activation, m.normalization, m.layernorm_epsilon, m.position_embedding, m.rotary_base) == (
        "geglu", "RMSNorm", 1e-6, "rope", 10000)
    assert m.tie_embeddings and m.scale_embeddings and not m.add_bias_linear
    assert load_recipe(ROOT / "recipes" / "gemma-2b-owt.yaml").loss.softcap == 30.0
    assert (m.post_norms, m.zero_centered_norm, m.attention_softcap, m.sliding_window) == (True, True, 50.0, 4096)
    from cce_parallel.hf.convert import architecture

    assert architecture(load_recipe(ROOT / "recipes" / "gemma-2b-owt.yaml")) == "gemma2"


def test_an_odd_head_size_with_rope_is_refused():
    """hidden 60 over 4 heads is a head size of 15: rotary embeddings need an even one. The recipe
    check says so, instead of megatron-core's shape error in the first training step."""
    with pytest.raises(RecipeError, match="^model.num_attention_heads: gives a head size of 15 .*even head size"):
        recipe_from_dict({"model": {"hidden_size": 60, "num_attention_heads": 4, "position_embedding": "rope"}})
    with pytest.raises(RecipeError, match="^model.kv_channels: gives a head size of 15"):
        recipe_from_dict({"model": {"kv_channels": 15, "position_embedding": "rope"}})
    recipe_from_dict({"model": {"hidden_size": 60, "num_attention_heads": 4}})  # learned positions: fine


def test_gemma2_options_are_checked():
    for model, key in (({"attention_softcap": 0.0}, "model.attention_softcap"),
                       ({"sliding_window": -1}, "model.sliding_window"),
                       ({"post_norms": True, "attention": "te"}, "model.attention: te cannot express model.post_norms"),
                       ({"attention_softcap": 50.0, "attention_dropout": 0.1}, "model.attention_dropout")):
        with pytest.raises(RecipeError, match=f"^{key}"):
            recipe_from_dict({"model": model})
    with pytest.raises(RecipeError, match="^loss.softcap"):
        load_recipe(ROOT / "recipes" / "gemma-2b-owt.yaml", ["loss.impl=megatron"])


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_dry_run(path):
    """--dry-run builds every stage on the meta device; sizes match the models the recipes name."""
    from cce_parallel.train.estimate import dry_run

    recipe = load_recipe(path)
    world = WORLD.get(path.stem, 4)
    report = dry_run(recipe, world_size=world, quiet=True)
    expected = {"tiny": (0.1e6, 0.3e6), "gpt2-small-owt": (124e6, 125e6), "llama-1b-owt": (1.2e9, 1.3e9),
                "gemma-2b-owt": (2.61e9, 2.62e9), "llama3-8b-owt": (8.02e9, 8.04e9)}.get(path.stem)
    if expected:
        assert expected[0] <= report["params_total"] <= expected[1], report["params_total"]
    assert report["world"] == report["tp"] * report["pp"] * report["dp"] == world
    last = report["memory"][-1]
    assert last["loss_cce"] < last["loss_megatron"]
    assert report["vocab"] % (recipe.model.make_vocab_size_divisible_by * report["tp"]) == 0


@pytest.mark.parametrize("layout", [[], ["parallel.tensor=4", "parallel.pipeline=2"]], ids=["tp8", "tp4-pp2"])
def test_llama3_8b_dry_run_on_eight_gpus(layout):
    """The Llama 3.1 8B recipe on one node of 8 GPUs, at TP 8 and at TP 4 x PP 2 (the header's
    --set line): 8.03B parameters (Meta's count), each rank about an eighth of them, and every
    rank's estimate within an H200 (141 GB) with room to spare; CCE's loss layer below megatron's."""
    from cce_parallel.train.estimate import dry_run

    report = dry_run(load_recipe(ROOT / "recipes" / "llama3-8b-owt.yaml", layout), world_size=8, quiet=True)
    tp, pp = (4, 2) if layout else (8, 1)
    assert (report["tp"], report["pp"], report["dp"], report["vocab"]) == (tp, pp, 1, 128256)
    assert 8.02e9 <= report["params_total"] <= 8.04e9, report["params_total"]
    assert len(report["stages"]) == pp and sum(s["layers"] for s in report["stages"]) == 32
    for stage in report["stages"]:  # embedding and output layer on different stages at PP 2
        assert abs(stage["params_local"] - 8.03e9 / 8) < 0.01e9, stage
    assert [s["output_layer"] for s in report["stages"]][-1] == "CCEOutputLayer"
    last = report["memory"][-1]
    assert last["loss_cce"] < last["loss_megatron"]
    for stage in report["memory"]:  # H200s peaked at 1.4x the estimate on the Llama 3.2 1B recipe
        assert stage["total_megatron"] < 0.5 * 141e9, stage
    assert abs(report["save"]["bytes"] - 14 * 8.03e9) < 0.01 * 14 * 8.03e9  # bf16 weights + fp32 Adam state


def test_dry_run_with_pipeline_and_megatron_loss():
    from cce_parallel.train.estimate import dry_run

    recipe = load_recipe(ROOT / "recipes" / "gpt2-small-owt.yaml",
                         ["parallel.pipeline=2", "parallel.sequence_parallel=true", "loss.impl=megatron"])
    report = dry_run(recipe, world_size=8, quiet=True)
    assert len(report["stages"]) == 2
    assert 124e6 <= report["params_total"] <= 125e6  # the last stage's tied embedding counted once
    assert report["stages"][1]["output_layer"] == "ColumnParallelLinear"


@pytest.mark.parametrize(
    "budget, vocab, hidden, measured_mib",
    [("auto", 256000, 2304, 2286), ("lean", 256000, 2304, 1258), ("3221225472", 152064, 3584, 3566),
     ("3221225472", 256000, 2304, 3302), ("auto", 152064, 3584, 1868), ("auto", 128256, 4096, 1767),
     ("auto", 32064, 3072, 787), ("268435456", 32064, 3072, 635)],
)
def test_dry_run_cce_loss_memory_matches_a_measured_peak(budget, vocab, hidden, measured_mib):
    """The estimate of the CCE loss layer against the peaks measured on an H100 (8,192 tokens,
    bf16; benchmarks/results/h100_20261125.md, where Phi 3.5 mini's auto is the 512 MiB row and
    its 256 MiB budget the auto row of that run's working tree, and h100_20261125_budgets.md for
    3 GiB) for the heads of Gemma 2 2B, Qwen 2.5 7B, Llama 3 8B (auto: four blocks of 2,048
    tokens, bf16 dC and fp32 target rows), Phi 3.5 mini (auto: one block), Gemma 2 2B lean, Qwen
    2.5 7B in one block and Gemma 2 2B in two at 3 GiB, and Phi 3.5 mini in two at 256 MiB."""
    import torch

    from cce_parallel.train.estimate import cce_loss_bytes

    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [f"loss.logits_budget={budget}"])
    estimate = cce_loss_bytes(recipe, 8192, vocab, hidden, torch.bfloat16) / 2**20
    assert abs(estimate - measured_mib) < 0.05 * measured_mib, estimate


def test_dry_run_cce_loss_memory_follows_the_path():
    """softcap with label smoothing takes the two-pass variant, whose buffer holds fp32 logits:
    "auto" then asks for all the logits in one block (dC sums in fp32), capped at 3 GiB. On the
    fused path dC is bf16, but fp32 where it goes into an fp32 main_grad."""
    import torch

    from cce_parallel.train.estimate import cce_loss_bytes

    def mib(*overrides):
        recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", ["loss.logits_budget=auto", *overrides])
        return cce_loss_bytes(recipe, 8192, 256000, 2304, torch.bfloat16) / 2**20

    fused, two_pass = mib("loss.softcap=30.0"), mib("loss.softcap=30.0", "loss.label_smoothing=0.1")
    # One block (Phi 3.5 mini's head): bf16 dC, unless an fp32 main_grad takes it.
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", ["loss.logits_budget=auto"])
    one_block = [cce_loss_bytes(recipe, 8192, 32064, 3072, torch.bfloat16, main_grad=g) for g in (False, True)]
    assert one_block[1] - one_block[0] == 32064 * 3072 * 2
    assert fused == mib() and two_pass != fused
    # fp32 dC: all 8,192 x 256,000 fp32 logits, capped at 3 GiB, which hold 3,145 rows of 256,000:
    # three equal blocks of 2,731 tokens.
    assert abs(two_pass - (4 * (8192 + 256000) * 2304 + 2731 * 256000 * 4) / 2**20) < 1


def test_dry_run_activations_shrink_with_recompute():
    """--dry-run's activation estimate: full < none = selective core_attn (flash-style
    attention keeps no s² scores), and full uniform keeps one layer input per chunk plus one chunk."""
    from cce_parallel.train.estimate import activation_bytes, dry_run

    base = ["train.micro_batch_size=4", "model.num_layers=8"]
    path = ROOT / "recipes" / "gpt2-small-owt.yaml"

    def activations(*overrides):
        report = dry_run(load_recipe(path, base + list(overrides)), world_size=4, quiet=True)
        return report["memory"][0]["activations"]

    none = activations()
    core_attn = activations("model.recompute_granularity=selective")
    full = ["model.recompute_granularity=full", "model.recompute_method=uniform"]
    uniform1, uniform4 = activations(*full, "model.recompute_num_layers=1"), activations(*full, "model.recompute_num_layers=4")
    block = ["model.recompute_granularity=full", "model.recompute_method=block"]
    block2, block8 = activations(*block, "model.recompute_num_layers=2"), activations(*block, "model.recompute_num_layers=8")
    assert core_attn == none
    assert uniform1 == block8 < block2 < none  # block over all layers = uniform chunks of 1
    assert uniform1 < uniform4 < none

    recipe = load_recipe(path, base)
    tp = recipe.parallel.tensor
    sbh = 4 * recipe.model.seq_length * recipe.model.hidden_size  # bf16: 2 bytes per element
    layer, layer_input = sbh * (10 + 24 / tp), 2 * sbh
    assert none == pytest.approx(8 * layer)
    assert uniform1 == pytest.approx(8 * layer_input + layer)
    assert uniform4 == pytest.approx(2 * layer_input + 4 * layer)
    assert block2 == pytest.approx(2 * layer_input + 6 * layer + layer)
    assert activation_bytes(recipe, layers=8, in_flight=3, width=2) == pytest.approx(3 * none)


def test_impl_list_matches_the_package():
    import cce_parallel

    assert tuple(CCE_IMPLS) == tuple(cce_parallel.IMPLS)
    # The rest are megatron-core's own loss paths, which no CCE layer stands in for.
    assert LOSS_IMPLS == CCE_IMPLS + ("megatron", "megatron_fused")
    assert [load_recipe(None, [f"loss.impl={impl}"]).loss.is_cce for impl in LOSS_IMPLS[-2:]] == [False, False]


def test_kernel_config_is_checked_against_the_kernels():
    from cce_parallel.train.launch import CPU_KERNEL_CONFIG, check_kernel_config

    check_kernel_config(CPU_KERNEL_CONFIG)
    for bad, match in (({"fwd_block_q": 64}, "fwd_block_q"), ({"fwd_block_n": 100}, "power of two")):
        with pytest.raises(RecipeError, match=f"^loss.kernel_config: .*{match}"):
            check_kernel_config(bad)


def test_every_field_is_documented():
    """Each field has an attribute docstring in its section's module (config/model.py,
    config/training.py: the recipe reference)."""
    import inspect

    for section in dataclasses.fields(Recipe):
        source = inspect.getsource(inspect.getmodule(section.type))
        for f in dataclasses.fields(section.type):
            marker = f"    {f.name}: "
            start = source.index(marker, source.index(f"class {section.type.__name__}("))
            following = source[start:].splitlines()[1].strip()
            assert following.startswith('"""'), f"{section.name}.{f.name} has no docstring"


# -- broken recipes -------------------------------------------------------------------------------


def _error(raw=None, overrides=(), world=None, device="cpu") -> str:
    with pytest.raises(RecipeError) as info:
        for item in overrides:
            apply_override(raw := raw or {}, item)
        recipe = recipe_from_dict(raw or {})
        if world is not None:
            recipe.check_world(world, device)
    return str(info.value)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"model": {"hidden_sise": 64}}, "model.hidden_sise: unknown key"),
        ({"modle": {}}, "modle: unknown section"),
        ({"model": {"num_layers": "2"}}, "model.num_layers: expected an int"),
        ({"model": {"num_layers": 2.0}}, "model.num_layers: expected an int"),
        ({"parallel": {"sequence_parallel": 1}}, "parallel.sequence_parallel: expected a bool"),
        ({"train": {"steps": True}}, "train.steps: expected an int"),
        ({"loss": {"impl": "cce_fast"}}, "loss.impl: expected one of"),
        ({"optim": {"lr": "fast"}}, "optim.lr: expected a number"),
        ({"loss": {"kernel_config": {"fwd_block_n": "64"}}}, "loss.kernel_config: expected a mapping"),
        ({"model": ["num_layers"]}, "model: must be a mapping"),
        ({"checkpoint": {"signals": "SIGTERM"}}, "checkpoint.signals: expected a list of a string"),
        ({"checkpoint": {"signals": ["SIGTERM", 15]}}, "checkpoint.signals: expected a list of a string"),
        ({"train": {"deterministic": "yes"}}, "train.deterministic: expected a bool"),
    ],
)
def test_unknown_keys_and_wrong_types(raw, key):
    assert _error(raw).startswith(key)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"model": {"num_attention_heads": 6, "hidden_size": 96}, "parallel": {"tensor": 4}}, "model.num_attention_heads"),
        ({"model": {"num_query_groups": 1}, "parallel": {"tensor": 2}}, "model.num_query_groups"),
        ({"model": {"num_attention_heads": 3}}, "model.num_attention_heads"),
        ({"model": {"num_layers": 3}, "parallel": {"pipeline": 2}}, "model.num_layers"),
        ({"train": {"global_batch_size": 6}}, "train.global_batch_size"),
        ({"parallel": {"data": 3}, "train": {"global_batch_size": 8}}, "train.global_batch_size"),
        ({"train": {"grad_accumulation": 3}, "parallel": {"data": 1}}, "train.global_batch_size"),
        ({"parallel": {"tensor": 1, "sequence_parallel": True}}, "parallel.sequence_parallel"),
        ({"loss": {"impl": "megatron", "z_loss": 1e-4}}, "loss.z_loss"),
        ({"loss": {"impl": "megatron_fused", "z_loss": 1e-4}}, "loss.z_loss: is not supported by loss.impl=megatron_fused"),
        ({"loss": {"impl": "megatron_fused", "softcap": 30.0}}, "loss.softcap"),
        ({"loss": {"impl": "megatron_fused", "label_smoothing": 0.1}}, "loss.label_smoothing"),
        ({"loss": {"impl": "megatron", "fusion_impl": "native"}}, "loss.fusion_impl: only applies to loss.impl=megatron_fused"),
        ({"loss": {"fusion_impl": "te"}}, "loss.fusion_impl"),
        ({"optim": {"warmup_steps": 50}}, "optim.warmup_steps"),
        ({"optim": {"min_lr": 1.0}}, "optim.min_lr"),
        ({"model": {"seq_length": 0}}, "model.seq_length"),
        ({"train": {"stop_at": 99}}, "train.stop_at"),
        ({"data": {"tokenizer": "gpt2"}}, "data.tokenizer"),
        ({"model": {"recompute_granularity": "full", "recompute_num_layers": 1}}, "model.recompute_method"),
        ({"model": {"recompute_granularity": "full", "recompute_method": "block"}}, "model.recompute_num_layers"),
        ({"model": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 0}},
         "model.recompute_num_layers"),
        ({"model": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3}},
         "model.recompute_num_layers"),
        ({"model": {"num_layers": 4, "recompute_granularity": "full", "recompute_method": "block",
                    "recompute_num_layers": 3}, "parallel": {"pipeline": 2}}, "model.recompute_num_layers"),
        ({"model": {"recompute_granularity": "selective", "recompute_method": "block"}}, "model.recompute_method"),
        ({"model": {"recompute_granularity": "selective", "recompute_num_layers": 1}}, "model.recompute_num_layers"),
        ({"model": {"recompute_method": "uniform"}}, "model.recompute_method"),
        ({"model": {"recompute_granularity": "selective", "recompute_modules": "core_attn,moe"}},
         "model.recompute_modules"),
        ({"model": {"recompute_granularity": "selective", "recompute_modules": " , "}}, "model.recompute_modules"),
        ({"model": {"recompute_granularity": "selective", "recompute_modules": "core_attn,core_attn"}},
         "model.recompute_modules"),
        ({"model": {"recompute_granularity": "selective", "recompute_modules": "core_attn,mlp"}},
         "model.recompute_modules"),
        ({"model": {"recompute_granularity": "selective", "recompute_modules": "layernorm"}},
         "model.recompute_modules"),
        ({"model": {"recompute_granularity": "partial"}}, "model.recompute_granularity"),
        ({"model": {"rope_scaling_factor": 32.0}}, "model.rope_scaling_factor"),
        ({"model": {"position_embedding": "rope", "rope_scaling_factor": 0.0}}, "model.rope_scaling_factor"),
        ({"checkpoint": {"signals": ["SIGTERN"]}}, "checkpoint.signals: 'SIGTERN' is not a signal"),
        ({"checkpoint": {"signals": ["SIGKILL"]}}, "checkpoint.signals: 'SIGKILL' is not a signal that can be caught"),
        ({"checkpoint": {"signals": ["SIGUSR1", "SIGUSR1"]}}, "checkpoint.signals: lists a signal twice"),
        ({"checkpoint": {"signal_deadline_s": 0}}, "checkpoint.signal_deadline_s: must be > 0"),
    ],
)
def test_inconsistent_sizes(raw, key):
    assert _error(raw).startswith(key)


def test_selective_mlp_recompute_is_refused_with_its_reason():
    message = _error({"model": {"recompute_granularity": "selective", "recompute_modules": "mlp"}})
    assert message.startswith("model.recompute_modules: mlp is not supported") and "recompute_granularity=full" in message


def test_world_size_mismatch():
    assert _error({"parallel": {"tensor": 2, "data": 2}}, world=2).startswith("parallel.data")
    assert "world size is 2" in _error({"parallel": {"tensor": 2, "data": 2}}, world=2)
    assert _error({"parallel": {"tensor": 2}}, world=3).startswith("parallel.tensor")
    assert _error({"train": {"global_batch_size": 8}}, world=6).startswith("train.global_batch_size")
    assert _error({"train": {"micro_batch_size": 4, "global_batch_size": 12}}, world=4).startswith(
        "train.global_batch_size"
    )
    assert Recipe().check_world(2, "cpu") == (1, 2)
    assert Recipe().check_world(4, "cpu") == (2, 1)


def test_every_rank_reports_a_bad_recipe(monkeypatch, capsys):
    """Under torchrun a rank other than 0 waits for rank 0 to report (the first rank to exit stops
    the rest), then reports the error itself: one that only it met is not lost."""
    pytest.importorskip("yaml")
    import cce_parallel.train.__main__ as cli

    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    argv = ["--set", "train.steps=10", "train.stop_at=11"]
    monkeypatch.setenv("RANK", "1")
    assert cli.main(argv) == 2
    assert waits == [cli.QUIET_RANK_WAIT_S]
    assert capsys.readouterr().err == "cce-train: invalid recipe: train.stop_at: 11 is past train.steps=10\n"
    monkeypatch.setenv("RANK", "0")
    assert cli.main(argv) == 2
    assert waits == [cli.QUIET_RANK_WAIT_S]  # rank 0 does not wait
    assert capsys.readouterr().err == "cce-train: invalid recipe: train.stop_at: 11 is past train.steps=10\n"

    # A SIGTERM during the wait (torchrun stopping the others once rank 0 has exited) ends it at
    # once and in silence; the handler from before is back afterwards.
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: (waits.append(seconds), os.kill(os.getpid(), signal.SIGTERM)))
    monkeypatch.setenv("RANK", "1")
    noted = []

    def mine(*_):  # a SIGTERM that gets past the wait's own handler is noted here
        noted.append(1)

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert cli.main(argv) == 2
        assert len(waits) == 2 and capsys.readouterr().err == "" and noted == []
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_more_processes_per_node_than_gpus(monkeypatch, capsys):
    """A node that would start more processes than it has GPUs (each rank takes its local rank's)
    is refused before any process starts, in one line, not by rank N's "invalid device ordinal"."""
    pytest.importorskip("yaml")
    import cce_parallel.train.__main__ as cli
    from cce_parallel.train import launch

    from cce_parallel.train import data

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(data, "prepare", lambda *a: pytest.fail("went on to prepare the data"))
    monkeypatch.setattr(launch, "relaunch", lambda *a: pytest.fail("went on to start torchrun"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["--set", "run.device=cuda", "train.steps=10"]) == 2  # the tiny recipe: 2 processes
    err = capsys.readouterr().err
    assert err.startswith("cce-train: invalid recipe: run.device: cuda, 2 processes on this node") and \
        "torch sees 1 CUDA device(s)" in err and "--nproc-per-node=1" in err and err.count("\n") == 1, err
    # Under torchrun the node's share is LOCAL_WORLD_SIZE.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="2 processes on this node"):
        launch.check_gpus("cuda", int(os.environ["LOCAL_WORLD_SIZE"]))
    launch.check_gpus("cuda", 1)
    launch.check_gpus("cpu", 8)


def test_cuda_only_features_on_cpu():
    assert _error({"parallel": {"pipeline": 2}}, world=4).startswith("parallel.pipeline")
    assert _error({"parallel": {"distributed_optimizer": True}}, world=2).startswith("parallel.distributed_optimizer")
    assert _error({"train": {"precision": "bf16"}}, world=2).startswith("train.precision")
    rope = recipe_from_dict({"model": {"position_embedding": "rope"}})  # the local spec's RoPE runs on CPU
    assert rope.check_world(2, "cpu") == Recipe().check_world(2, "cpu")
    te_loss = {"loss": {"impl": "megatron_fused", "fusion_impl": "te"}}
    assert _error(te_loss, world=2).startswith("loss.fusion_impl: te (Transformer Engine's parallel_cross_entropy")
    assert recipe_from_dict(te_loss).check_world(2, "cuda") == Recipe().check_world(2, "cuda")
    native = recipe_from_dict({"loss": {"impl": "megatron_fused", "fusion_impl": "native"}})
    assert native.check_world(2, "cpu") == Recipe().check_world(2, "cpu")
    recipe = recipe_from_dict({"parallel": {"pipeline": 2}})
    assert recipe.check_world(4, "cuda") == (1, 2)
    full = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
    assert _error({"model": full}, world=2).startswith("model.recompute_granularity")
    assert recipe_from_dict({"model": full}).check_world(2, "cuda") == Recipe().check_world(2, "cuda")


def test_recompute_keys_are_valid_megatron_configs():
    """The accepted combinations build megatron-core TransformerConfigs (which check them too)."""
    pytest.importorskip("megatron.core")
    import torch

    from cce_parallel.train.gpt import transformer_config

    for model in (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "recompute_modules": " core_attn"},
        {"recompute_granularity": "selective", "recompute_modules": "layernorm", "attention": "te"},
    ):
        config = transformer_config(recipe_from_dict({"model": model}), dtype=torch.float32, cpu_init=True)
        assert config.recompute_granularity == model["recompute_granularity"]
        assert config.recompute_method == model.get("recompute_method")
        assert config.recompute_num_layers == model.get("recompute_num_layers")
        if model["recompute_granularity"] == "selective":
            assert config.recompute_modules == [x.strip() for x in model["recompute_modules"].split(",")]


def test_overrides():
    recipe = load_recipe(None, ["optim.lr=3e-4", "optim.min_lr=0", "model.vocab_size=null", "parallel.sequence_parallel=true",
                                "loss.logits_budget=lean", "loss.kernel_config={fwd_block_n: 64}"])
    assert recipe.optim.lr == 3e-4 and isinstance(recipe.optim.lr, float)
    assert recipe.parallel.sequence_parallel is True
    assert recipe.loss.kernel_config == {"fwd_block_n": 64}
    assert recipe.loss.logits_budget == "lean"
    for bad in ("optim.lr", "lr=1", "a.b.c=1", "=1"):
        with pytest.raises(RecipeError, match="section.key=value"):
            load_recipe(None, [bad])
    with pytest.raises(RecipeError, match="^optim.nope: unknown key"):
        load_recipe(None, ["optim.nope=1"])


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(RecipeError, match="mapping of sections"):
        load_recipe(bad)
    bad.write_text("model: {num_layers: [\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    good = tmp_path / "r.yaml"
    good.write_text("optim:\n  lr: 3e-4\n  min_lr: 1e-5\n")  # YAML 1.1 would read 3e-4 as a string
    assert load_recipe(good).optim.lr == 3e-4


def test_data_dir_default():
    assert Recipe().data.resolved_dir() == "data/stdlib-bpe-1024"
    recipe = load_recipe(ROOT / "recipes" / "gpt2-small-owt.yaml")
    assert recipe.data.resolved_dir() == "data/openwebtext-hf_gpt2"


def test_signal_lists_load_and_round_trip():
    recipe = load_recipe(None, ["checkpoint.signals=[SIGUSR2]", "checkpoint.signal_deadline_s=90"])
    assert recipe.checkpoint.signals == ["SIGUSR2"] and recipe.checkpoint.signal_deadline_s == 90.0
    assert load_recipe(None, ["checkpoint.signals=[]"]).checkpoint.signals == []
    assert Recipe().checkpoint.signals == ["SIGTERM", "SIGUSR1"]


def test_allocator_default_keeps_the_users_setting(monkeypatch, capsys):
    from cce_parallel.train import launch

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert "the train job's default" in launch.allocator_default()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "expandable_segments:True" in capsys.readouterr().out
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert "set by the user" in launch.allocator_default()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert "PYTORCH_ALLOC_CONF=expandable_segments:False (set by the user)" in launch.allocator_default()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_deterministic_mode_reaches_megatron():
    from cce_parallel.train.gpt import transformer_config

    for flag in (False, True):
        recipe = load_recipe(None, [f"train.deterministic={str(flag).lower()}"])
        assert transformer_config(recipe, dtype=torch.float32, cpu_init=True).deterministic_mode is flag


def test_megatron_fused_turns_megatrons_loss_fusion_on(monkeypatch):
    """loss.impl=megatron_fused: GPTModel computes its loss with cross_entropy_loss_fusion; auto picks
    te only with Transformer Engine installed and CUDA available; te without TE names the key."""
    from cce_parallel.train import gpt

    def config(*overrides):
        recipe = load_recipe(None, list(overrides))
        c = gpt.transformer_config(recipe, dtype=torch.float32, cpu_init=True)
        return c.cross_entropy_loss_fusion, c.cross_entropy_fusion_impl

    assert config() == config("loss.impl=megatron") == (False, "native")
    for te, cuda, expected in ((False, False, "native"), (True, False, "native"), (False, True, "native"),
                               (True, True, "te")):
        monkeypatch.setattr(gpt, "have_te", lambda te=te: te)
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert config("loss.impl=megatron_fused") == (True, expected)
        assert config("loss.impl=megatron_fused", "loss.fusion_impl=native") == (True, "native")
    monkeypatch.setattr(gpt, "have_te", lambda: False)
    with pytest.raises(RecipeError, match="^loss.fusion_impl: te, but Transformer Engine is not installed"):
        config("loss.impl=megatron_fused", "loss.fusion_impl=te")


def test_every_recipe_key_is_documented():
    """docs/recipes.md renders each section field's docstring (cce_parallel.config.reference): a
    field without one would show an empty meaning there."""
    import dataclasses

    from cce_parallel.config.reference import field_docs
    from cce_parallel.config.schema import Recipe

    for section in dataclasses.fields(Recipe):
        cls = section.default_factory().__class__
        undocumented = sorted({f.name for f in dataclasses.fields(cls)} - set(field_docs(cls)))
        assert not undocumented, f"{section.name}: fields without a docstring: {undocumented}"
