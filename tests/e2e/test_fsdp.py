"""parallel.fsdp in the train job, on CPU over gloo (Megatron-FSDP, CUDA only, is in
test_fsdp_gpu.py; here its recipe rules and --dry-run): PyTorch FSDP2 through megatron-core's
TorchFullyShardedDataParallel trains the tiny recipe as DDP does (with TP=2, gradient
accumulation and the tied embedding; and untied), a killed FSDP run resumes bitwise from its
sharded checkpoint, the unsupported combinations are rejected naming the keys, and --dry-run
reports the sharded per-rank memory."""

import os

import pytest
import torch

from cce_parallel.config import RecipeError, load_recipe
from tests.e2e.conftest import ROOT, base_overrides, kill_after_checkpoint, run_train


def _read(run_dir):
    from cce_parallel.train.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _column(metrics, key, steps):
    return [metrics["train"][s][key] for s in steps]


# -- recipes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["parallel.fsdp=megatron", "parallel.pipeline=2"], "parallel.pipeline=2"),
        (
            ["parallel.fsdp=megatron", "parallel.distributed_optimizer=true"],
            "parallel.distributed_optimizer=true",
        ),
        (
            ["parallel.fsdp=torch", "parallel.distributed_optimizer=true"],
            "parallel.distributed_optimizer=true",
        ),
        (["parallel.fsdp=torch", "parallel.overlap_grad_reduce=true"], "parallel.overlap_grad_reduce=true"),
        (["parallel.fsdp=torch", "parallel.pipeline=2"], "parallel.pipeline=2"),
        (["parallel.fsdp=zero3"], "parallel.fsdp"),
    ],
)
def test_unsupported_combinations_fail_naming_the_keys(overrides, named):
    with pytest.raises(RecipeError, match="parallel.fsdp") as err:
        load_recipe(None, overrides)
    assert named in str(err.value)
    assert "\n" not in str(err.value)


def test_dry_run_shards_weights_grads_and_adam_over_dp():
    """At dp=4 the sharded Adam state is a quarter of DDP's, the weights are a quarter plus the
    units FSDP gathers (a tied embedding stays gathered in the root unit)."""
    from cce_parallel.train.estimate import dry_run

    path = ROOT / "recipes" / "gpt2-small-owt.yaml"
    base = ["parallel.tensor=2", "parallel.distributed_optimizer=false", "parallel.overlap_grad_reduce=false"]
    ddp = dry_run(load_recipe(path, base), world_size=8, quiet=True)
    fsdp = dry_run(load_recipe(path, base + ["parallel.fsdp=torch"]), world_size=8, quiet=True)
    untied = dry_run(
        load_recipe(path, base + ["parallel.fsdp=torch", "model.tie_embeddings=false"]),
        world_size=8,
        quiet=True,
    )
    d, f = ddp["memory"][0], fsdp["memory"][0]
    P, gathered = fsdp["stages"][0]["params_local"], fsdp["stages"][0]["fsdp_gathered"]
    assert fsdp["dp"] == 4 and ddp["stages"][0]["fsdp_gathered"] == 0
    assert f["optimizer"] == pytest.approx(d["optimizer"] / 4)
    assert f["weights"] == pytest.approx(d["weights"] / 4 + gathered * 2)
    assert f["grads"] == pytest.approx(P * 6 / 4)  # bf16 shards + the optimizer's fp32 copies
    assert f["total_cce"] < d["total_cce"]
    # The root unit holds the [V/tp, h] output weight: tied, the embedding itself (with the position
    # embedding, its unit's other weight); untied, the output layer's own (the embedding is a unit).
    assert gathered > fsdp["vocab"] // 2 * 768
    assert gathered - untied["stages"][0]["fsdp_gathered"] == 1024 * 768  # gpt2's position embedding


def test_megatron_fsdp_needs_cuda():
    from cce_parallel.train.estimate import dry_run

    recipe = load_recipe(None, ["parallel.fsdp=megatron", "parallel.tensor=1"])
    with pytest.raises(RecipeError, match="parallel.fsdp: megatron .*needs CUDA.*parallel.fsdp=torch"):
        recipe.check_world(2, "cpu")
    with pytest.raises(RecipeError, match="needs CUDA"):
        dry_run(recipe, world_size=2, device="cpu", quiet=True)


def test_dry_run_megatron_fsdp():
    """Megatron-FSDP: the same shards as FSDP2, fp32 gradient shards plus fp32 buckets of the
    gathered units, and an untied embedding stays in the root unit (not a unit of its own)."""
    from cce_parallel.train.estimate import dry_run

    path = ROOT / "recipes" / "gpt2-small-owt.yaml"
    base = ["parallel.tensor=2", "parallel.distributed_optimizer=false", "parallel.overlap_grad_reduce=false"]
    ddp = dry_run(load_recipe(path, base), world_size=8, quiet=True)["memory"][0]
    torch_untied = dry_run(
        load_recipe(path, base + ["parallel.fsdp=torch", "model.tie_embeddings=false"]),
        world_size=8,
        quiet=True,
    )
    mfsdp = dry_run(
        load_recipe(path, base + ["parallel.fsdp=megatron", "model.tie_embeddings=false"]),
        world_size=8,
        quiet=True,
    )
    stage, mem = mfsdp["stages"][0], mfsdp["memory"][0]
    P, gathered = stage["params_local"], stage["fsdp_gathered"]
    assert mem["optimizer"] == pytest.approx(P * 12 / 4)  # fp32 main weights and two moments, sharded
    assert mem["grads"] == pytest.approx((P / 4 + gathered) * 4)
    assert mem["weights"] == pytest.approx(P * 2 / 4 + gathered * 2)
    # the untied embedding (word [V/tp, h] and gpt2's position embedding) is gathered with the root
    # here; FSDP2 makes it a unit of its own
    assert gathered - torch_untied["stages"][0]["fsdp_gathered"] == (mfsdp["vocab"] // 2 + 1024) * 768
    assert mem["total_cce"] < ddp["total_cce"]


# -- training runs --------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_dp2_accumulation_tied_matches_ddp(tiny_data, runs_dir):
    """4 ranks, TP=2 x FSDP over dp=2, 2 micro-batches per step, tied embedding: the losses and
    gradient norms of DDP (the CCE layer's ∇C and the lookup's gradient meet in FSDP's shard)."""
    steps = ["train.global_batch_size=16", "train.stop_at=3", "eval.interval=0", "eval.iters=1"]
    runs = {}
    for fsdp in ("none", "torch"):
        name = f"fsdp-tp2-{fsdp}"
        run_train(base_overrides(runs_dir, tiny_data, name) + steps + [f"parallel.fsdp={fsdp}"], nproc=4)
        runs[fsdp] = _read(runs_dir / name)
    layout = runs["torch"]["meta"][0]["layout"]
    assert (layout["tp"], layout["dp"], layout["accumulation"]) == (2, 2, 2)
    assert runs["torch"]["meta"][0]["recipe"]["model"]["tie_embeddings"] is True
    assert _column(runs["torch"], "loss", range(1, 4)) == pytest.approx(
        _column(runs["none"], "loss", range(1, 4)), rel=1e-6
    )
    assert _column(runs["torch"], "grad_norm", range(1, 4)) == pytest.approx(
        _column(runs["none"], "grad_norm", range(1, 4)), rel=1e-5
    )


@pytest.fixture(scope="module")
def untied_runs(tiny_data, runs_dir):
    """TP=1 x dp=2, untied output layer, 8 steps: DDP, and FSDP with checkpoints every 4 steps."""
    common = [
        "parallel.tensor=1",
        "model.tie_embeddings=false",
        "train.stop_at=8",
        "eval.interval=4",
        "eval.iters=1",
    ]
    runs = {}
    for fsdp in ("none", "torch"):
        name = f"fsdp-untied-{fsdp}"
        run_train(
            base_overrides(runs_dir, tiny_data, name)
            + common
            + [f"parallel.fsdp={fsdp}", "checkpoint.interval=4"]
        )
        runs[fsdp] = _read(runs_dir / name)
    return common, runs


@pytest.mark.distributed
@pytest.mark.slow
def test_untied_matches_ddp(untied_runs):
    _, runs = untied_runs
    steps = range(1, 9)
    assert _column(runs["torch"], "loss", steps) == pytest.approx(
        _column(runs["none"], "loss", steps), rel=1e-6
    )
    assert _column(runs["torch"], "grad_norm", steps) == pytest.approx(
        _column(runs["none"], "grad_norm", steps), rel=1e-5
    )
    assert runs["torch"]["eval"][8]["val_loss"] == pytest.approx(
        runs["none"]["eval"][8]["val_loss"], rel=1e-6
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_kill_and_resume_is_bitwise(untied_runs, tiny_data, runs_dir):
    """SIGKILL an FSDP run after its step-4 checkpoint (every rank wrote its shards); the restart
    loads the shards into its DTensor parameters and Adam state, and steps 5-8 are bitwise the
    uninterrupted run's."""
    common, runs = untied_runs
    run_dir = runs_dir / "fsdp-killed"
    overrides = (
        base_overrides(runs_dir, tiny_data, "fsdp-killed")
        + common
        + ["parallel.fsdp=torch", "checkpoint.interval=4"]
    )
    killed_at, _ = kill_after_checkpoint(overrides, run_dir, min_step=5)
    assert killed_at < 8, "killed too late to test the resume from step 4"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_0000004").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    done = run_train(overrides)
    assert "resumed from" in done.stdout
    resumed = _read(run_dir)
    assert list(resumed["resume"]) == [4]
    steps = range(5, 9)
    assert _column(resumed, "loss", steps) == _column(runs["torch"], "loss", steps)  # bitwise
    assert _column(resumed, "grad_norm", steps) == _column(runs["torch"], "grad_norm", steps)
    assert resumed["eval"][8]["val_loss"] == runs["torch"]["eval"][8]["val_loss"]


# -- the CCE layer under FSDP --------------------------------------------------------------------


def _tied_embedding_in_its_own_unit(rank, world_size, report):
    from megatron.core import parallel_state

    from cce_parallel.config import Recipe
    from cce_parallel.train.engine import torch_fsdp
    from cce_parallel.train.gpt import build_gpt, transformer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    recipe = Recipe()
    recipe.parallel.tensor = 1
    config = transformer_config(recipe, dtype=torch.float32, cpu_init=True)
    model = build_gpt(recipe, config, vocab_size=128, device="cpu")  # tied
    recipe.model.tie_embeddings = False  # so torch_fsdp makes the embedding a unit of its own
    chunk = torch_fsdp(recipe, model, config)
    s = recipe.model.seq_length
    tokens = torch.randint(0, 128, (2, s))
    report.started("forward")
    try:
        chunk(tokens, torch.arange(s).expand(2, s), None, labels=tokens)
        report.result("error", None)
    except TypeError as err:
        report.result("error", str(err))
    parallel_state.destroy_model_parallel()


@pytest.mark.distributed
def test_cce_layer_rejects_an_fsdp_sharded_weight():
    """A tied embedding resharded after its own unit's forward reaches the output layer as a DTensor
    sharded over the data-parallel mesh; the layer must not take that mesh for the vocabulary's."""
    from tests.dist import spawn

    outcome = spawn(_tied_embedding_in_its_own_unit, 2)
    assert outcome.ok, outcome.describe()
    for message in outcome.merged()["error"].values():
        assert message is not None and "the output weight is a DTensor" in message


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_switches_between_ddp_and_fsdp(untied_runs, tiny_data, runs_dir):
    """A DDP checkpoint resumes under FSDP and an FSDP one under DDP (DCP reshards the full
    tensors into the shards and back): steps 5-8 give the uninterrupted runs' losses."""
    common, runs = untied_runs
    steps = range(5, 9)
    for saved, resumed in (("none", "torch"), ("torch", "none")):
        name = f"fsdp-switch-{saved}-{resumed}"
        checkpoint = runs_dir / f"fsdp-untied-{saved}" / "checkpoints" / "step_0000004"
        done = run_train(
            base_overrides(runs_dir, tiny_data, name)
            + common
            + [f"parallel.fsdp={resumed}", f"checkpoint.resume={checkpoint}"]
        )
        assert "resumed from" in done.stdout
        losses = _column(_read(runs_dir / name), "loss", steps)
        assert losses == pytest.approx(_column(runs[resumed], "loss", steps), rel=1e-6)


# -- the CUDA engine (megatron-core's optimizer, Float16Module) on CPU tensors ----------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_megatron_engine_fsdp_matches_ddp_and_resumes(tmp_path, tiny_data):
    """engine._megatron with parallel.fsdp=torch, run on CPU tensors by megatron_engine_worker.py
    (dp=2): in fp32 the CPU engine's DDP losses and gradient norms; in bf16 (megatron's
    Float16OptimizerWithFloat16Params over the DTensor shards) megatron DDP's within bf16
    tolerance; all resume bitwise from their checkpoints, the bf16 ones lean (checkpoint.lean: the
    bf16 weights left out and restored from the fp32 main weights, sharded and not)."""
    from tests.e2e.test_megatron_engine import run_engines

    bf16 = ["parallel.tensor=1", "train.global_batch_size=16", "loss.impl=megatron"]  # bf16 CCE needs a GPU
    bf16.append("checkpoint.lean=true")
    runs = run_engines(tmp_path, tiny_data, {
        "fp32": ("megatron", "fp32", "parallel.tensor=1", "parallel.fsdp=torch"),
        "cpu": ("cpu", "fp32", "parallel.tensor=1"),
        "bf16": ("megatron", "bf16", *bf16, "parallel.fsdp=torch"),
        "bf16_ddp": ("megatron", "bf16", *bf16),
    })
    fp32, ddp = runs["fp32"], runs["cpu"]
    assert fp32["model"] == "_TorchFSDP" and fp32["optimizers"] == ["FP32Optimizer"]
    assert [x[0] for x in fp32["losses"]] == pytest.approx([x[0] for x in ddp["losses"]], rel=1e-6)
    assert [x[1] for x in fp32["losses"]] == pytest.approx([x[1] for x in ddp["losses"]], rel=1e-5)
    assert fp32["resumed"] == fp32["losses"][3:]

    fsdp, ddp = runs["bf16"], runs["bf16_ddp"]
    assert fsdp["optimizers"] == ddp["optimizers"] == ["Float16OptimizerWithFloat16Params"]
    assert fsdp["model_weights"] == ddp["model_weights"] == "main_params"
    assert fsdp["left_out"] == fsdp["weights"] > 0 and ddp["left_out"] == ddp["weights"] > 0  # every bf16 weight
    assert [x[0] for x in fsdp["losses"]] == pytest.approx([x[0] for x in ddp["losses"]], rel=1e-3)
    assert fsdp["losses"][4][0] < fsdp["losses"][0][0] - 0.3
    assert fsdp["resumed"] == fsdp["losses"][3:]
    assert ddp["resumed"] == ddp["losses"][3:]


@pytest.mark.parametrize("fsdp", ["megatron", "torch"])
def test_megatron_fsdp_drops_one_hardware_queue(fsdp, monkeypatch):
    """launch/env.sh and the image set CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron's TP overlap);
    Megatron-FSDP needs more queues for its side streams: dropped with a warning, for it only."""
    from cce_parallel.train import launch

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    recipe = load_recipe(None, [f"parallel.fsdp={fsdp}", "parallel.tensor=1"])
    if fsdp == "megatron":
        with pytest.warns(UserWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=1 .* dropped"):
            launch.prepare_environment(recipe, "cuda")
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    else:
        launch.prepare_environment(recipe, "cuda")
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
