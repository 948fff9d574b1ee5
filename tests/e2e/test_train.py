"""The pretraining entry point, end to end on CPU: tiny recipe at TP=2 over gloo, TP=1 agreement,
megatron's loss, golden losses, and a SIGKILLed run resumed from its checkpoint."""

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import ROOT, base_overrides, kill_after_checkpoint, run_train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GOLDEN = ROOT / "tests" / "assets" / "tiny_losses.json"


def _losses(metrics, steps):
    return [metrics["train"][s]["loss"] for s in steps]


def test_tiny_tp2_trains(tiny_reference):
    """50 steps at TP=2: the loss falls, every artifact of a run is there."""
    from cce_parallel.config import Recipe, recipe_from_dict

    run_dir, metrics, done = tiny_reference
    train = metrics["train"]
    assert sorted(train) == list(range(1, 51))
    first, last = train[1]["loss"], sum(train[s]["loss"] for s in range(46, 51)) / 5
    assert abs(first - math.log(1024)) < 0.05, first  # starts near uniform over the vocabulary
    assert last < first - 0.6, (first, last)
    for record in train.values():
        assert record["lr"] > 0 and math.isfinite(record["grad_norm"]) and record["tokens_per_s"] > 0
    assert train[5]["peak_mem_max"] == max(train[5]["peak_mem_per_rank"]) > 0 and len(train[5]["peak_mem_per_rank"]) == 2
    assert sorted(metrics["eval"]) == [20, 40, 50]
    assert metrics["eval"][50]["val_ppl"] == pytest.approx(math.exp(metrics["eval"][50]["val_loss"]))
    assert metrics["eval"][50]["val_loss"] < metrics["eval"][20]["val_loss"] + 0.05

    meta = metrics["meta"][0]
    assert meta["layout"]["tp"] == 2 and meta["layout"]["world"] == 2 and meta["engine"] == "cpu"
    # The job passed the loss layer the schedule's 1 / micro-batches (CCEOptions.loss_scale).
    assert meta["layout"]["accumulation"] > 1 and meta["loss_scale"] == 1 / meta["layout"]["accumulation"]
    assert meta["params_rank0"] < meta["params_total"] < 2 * meta["params_rank0"]  # TP halves the sharded ones
    assert 0.1e6 < meta["params_total"] < 0.3e6

    resolved = recipe_from_dict(yaml.safe_load((run_dir / "recipe.yaml").read_text()))
    assert resolved.model == Recipe().model and resolved.run.name == "reference"

    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_0000050"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_0000040", "step_0000050"]  # keep: 2
    names = {p.name for p in (ckpt / "step_0000050").iterdir()}
    assert {"meta.json", ".metadata"} <= names, names  # a torch.distributed.checkpoint save
    assert sum(name.endswith(".distcp") for name in names) == 2, names  # one file per rank
    assert json.loads((ckpt / "step_0000050" / "meta.json").read_text())["format"] == 3
    assert "step     50/50" in done.stdout and "val ppl" in done.stdout
    # checkpoint.keep: 2 removes the older ones, and says so.
    removed = {s: metrics["checkpoint"][s]["pruned"] for s in (10, 20, 30, 40, 50)}
    assert removed == {10: [], 20: [], 30: [str(ckpt / "step_0000010")], 40: [str(ckpt / "step_0000020")],
                       50: [str(ckpt / "step_0000030")]}
    for step in (10, 20, 30):
        assert f"removed checkpoint {ckpt / f'step_{step:07d}'} (checkpoint.keep: 2)" in done.stdout
    # The run ends with its own summary (wandb's history and summary blocks are off).
    val, end = metrics["eval"][50], done.stdout.rstrip().splitlines()[-5:]
    assert end[0].startswith(f"reference finished: step 50 of 50, {50 * 8 * 64:,} tokens; ")
    assert end[1:4] == [f"  train loss {train[50]['loss']:.4f} | ppl {math.exp(train[50]['loss']):.2f} (step 50)",
                        f"  val loss {val['val_loss']:.4f} | val ppl {val['val_ppl']:.2f} (step 50)",
                        f"  checkpoint {ckpt / 'step_0000050'}"]
    stop = metrics["stop"][50]
    assert (stop["reason"], stop["tokens"], stop["train_loss"], stop["val_loss"]) == (
        "done", 50 * 8 * 64, train[50]["loss"], val["val_loss"])
    assert 0 < train[1]["elapsed_s"] < train[50]["elapsed_s"] < stop["elapsed_s"]
    print(f"tiny reference run: {done.seconds:.1f} s; loss {first:.3f} -> {last:.3f}")


def test_wandb_offline(tiny_reference):
    """The reference run logs to wandb offline: a run directory under the run's, nothing online."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb, or `make setup`)")
    run_dir, _, done = tiny_reference
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and (offline[0] / "files").is_dir(), offline
    assert (run_dir / "wandb_id").read_text().strip() in offline[0].name
    assert "wandb.init failed" not in done.stdout
    assert "Run history" not in done.stdout + done.stderr and "Run summary" not in done.stdout + done.stderr


def _data_fingerprint(data_dir: Path) -> str:
    """sha256 over the tokenized dataset's files: the stdlib text differs between Python builds
    (e.g. Debian's 3.11 against python.org's), and with it the losses."""
    digest = hashlib.sha256()
    for path in sorted(data_dir.glob("*")):
        if path.suffix in (".bin", ".idx"):
            digest.update(path.relative_to(data_dir).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_golden_losses(tiny_reference, tiny_data):
    """The first 10 losses against tests/assets, on the same tokenized data (same fingerprint)."""
    _, metrics, _ = tiny_reference
    losses = _losses(metrics, range(1, 11))
    fingerprint = _data_fingerprint(tiny_data)
    if os.environ.get("CCE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"python": sys.version.split()[0], "data_sha256": fingerprint,
                                      "recipe": "tiny", "losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    if golden["data_sha256"] != fingerprint:
        pytest.skip(
            f"golden losses are for other data (recorded on Python {golden['python']}, whose stdlib text is the "
            f"data; this is {sys.version.split()[0]} at {sys.base_prefix})"
        )
    assert losses == pytest.approx(golden["losses"], rel=1e-4, abs=1e-4)


def test_tp1_matches_tp2(tiny_reference, tiny_data, runs_dir):
    """The same recipe at TP=1, started as a plain `python -m` (world size 1): the same losses. Its 5
    steps are the whole run (train.steps, the decay kept at the recipe's 50), with
    checkpoint.at_end=false and interval 0, as a benchmark's run: no checkpoint at all."""
    _, reference, _ = tiny_reference
    run_train(base_overrides(runs_dir, tiny_data, "tp1") + ["parallel.tensor=1", "train.steps=5", "optim.decay_steps=50",
                                                            "checkpoint.at_end=false", "checkpoint.interval=0"], nproc=None)
    from cce_parallel.train.metrics import read_metrics

    assert not list((runs_dir / "tp1" / "checkpoints").glob("step_*"))
    metrics = read_metrics(runs_dir / "tp1" / "metrics.jsonl")
    assert metrics["meta"][0]["layout"]["world"] == 1
    assert _losses(metrics, range(1, 6)) == pytest.approx(_losses(reference, range(1, 6)), rel=1e-5)
    grad_norms = [metrics["train"][s]["grad_norm"] for s in range(1, 6)]
    assert grad_norms == pytest.approx([reference["train"][s]["grad_norm"] for s in range(1, 6)], rel=1e-4)


@pytest.fixture(scope="module")
def three_steps(tiny_data, runs_dir):
    """run(impl): the metrics of the tiny recipe at TP=2 for 3 steps with that loss.impl, each impl
    run once in this module (two tests compare against megatron's)."""
    from cce_parallel.train.metrics import read_metrics

    runs = {}

    def run(impl):
        if impl not in runs:
            name = f"{impl}-3steps"
            run_train(base_overrides(runs_dir, tiny_data, name) + [f"loss.impl={impl}", "train.stop_at=3"])
            runs[impl] = read_metrics(runs_dir / name / "metrics.jsonl")
        return runs[impl]

    return run


def test_megatron_loss_matches(tiny_reference, three_steps):
    """loss.impl=megatron (ColumnParallelLinear + vocab_parallel_cross_entropy) at TP=2: the same
    first loss, and close losses after a few steps."""
    _, reference, _ = tiny_reference
    metrics = three_steps("megatron")
    assert _losses(metrics, range(1, 4)) == pytest.approx(_losses(reference, range(1, 4)), rel=1e-4)


def test_megatron_fused_loss_matches_megatron(three_steps):
    """loss.impl=megatron_fused (megatron-core's cross_entropy_loss_fusion, native: torch.compile'd on
    CPU) at TP=2 trains like loss.impl=megatron: the same forward math, so the same first loss (to
    fp32 rounding; measured equal); then the fused loss's logit gradient, which megatron-core hands
    back in bf16 even for fp32 logits, moves the weights a little differently: measured 2e-6 and
    7e-8 relative at steps 2 and 3 (megatron-core 0.16.1, torch 2.13 CPU)."""
    runs = {impl: three_steps(impl) for impl in ("megatron", "megatron_fused")}
    assert runs["megatron"]["meta"][0]["loss_fusion"] is None
    assert runs["megatron_fused"]["meta"][0]["loss_fusion"] == "native"  # no Transformer Engine on CPU
    fused, unfused = _losses(runs["megatron_fused"], range(1, 4)), _losses(runs["megatron"], range(1, 4))
    assert fused[0] == pytest.approx(unfused[0], rel=1e-6)
    assert fused == pytest.approx(unfused, rel=1e-5)
    assert fused[2] < fused[0]  # it trains


def test_kill_and_resume(tiny_reference, tiny_data, runs_dir):
    """SIGKILL a torchrun run after its step-44 checkpoint; a restart resumes from it and its
    losses from step 45 on are bitwise the uninterrupted run's. The run starts from the
    uninterrupted run's step-40 checkpoint (checkpoint.resume names it), so that it trains 10
    steps rather than 50."""
    from cce_parallel.train.metrics import read_metrics

    reference_dir, reference, _ = tiny_reference
    run_dir = runs_dir / "killed"
    overrides = base_overrides(runs_dir, tiny_data, "killed") + ["checkpoint.interval=4"]
    start = f"checkpoint.resume={reference_dir / 'checkpoints' / 'step_0000040'}"
    killed_at, _ = kill_after_checkpoint(overrides + [start], run_dir, min_step=45)
    assert killed_at < 48, "killed too late to test the resume from step 44"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000044"

    done = run_train(overrides)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_0000044'} at step 44" in done.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert list(metrics["resume"]) == [40, 44]
    steps = range(41, 51)
    assert _losses(metrics, steps) == _losses(reference, steps)  # bitwise
    assert [metrics["train"][s]["lr"] for s in steps] == [reference["train"][s]["lr"] for s in steps]
    assert metrics["eval"][50]["val_loss"] == reference["eval"][50]["val_loss"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000050"


def test_extending_a_finished_run_warns_of_its_schedule(tiny_data, runs_dir):
    """A finished run started again with more train.steps resumes under the recipe's schedule, whose
    decay then spans the new length: the start says so once, with the next step's learning rate
    under both schedules and the override that keeps the checkpoint's; with that override the run
    goes on at the checkpoint's schedule (min_lr past its decay) and nothing is said. The first run
    has checkpoint.at_end=false and interval 2: of its 3 steps only step 2 is saved."""
    from cce_parallel.config import Recipe
    from cce_parallel.train.metrics import read_metrics

    min_lr, run_dir = Recipe().optim.min_lr, runs_dir / "extended"
    overrides = base_overrides(runs_dir, tiny_data, "extended") + [
        "parallel.tensor=1", "optim.warmup_steps=1", "eval.iters=1"]
    run_train(overrides + ["train.steps=3", "checkpoint.at_end=false", "checkpoint.interval=2"], nproc=None)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_0000002"]

    overrides.append("checkpoint.interval=0")
    kept = run_train(overrides + ["train.steps=5", "optim.decay_steps=3"], nproc=None)  # the fix, from step 2 on
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert "learning-rate schedule" not in kept.stderr and not metrics["schedule_change"]
    assert [metrics["train"][s]["lr"] for s in (4, 5)] == [min_lr, min_lr]

    extended = run_train(overrides + ["train.steps=7"], nproc=None)  # the checkpoint of step 5 decayed over 3
    warnings = [line for line in extended.stderr.splitlines() if "learning-rate schedule" in line]
    assert len(warnings) == 1, extended.stderr
    metrics = read_metrics(run_dir / "metrics.jsonl")
    change = metrics["schedule_change"][5]
    assert change["changed"] == {"optim.decay_steps": [3, 7]} and change["fix"] == "--set optim.decay_steps=3"
    assert change["differs_at"] == 6 and change["lr_checkpoint"] == min_lr
    assert change["lr_recipe"] == metrics["train"][6]["lr"] > min_lr  # the number said is the step's lr
    for text in ("step_0000005", "optim.decay_steps 3 -> 7 (unset: it follows train.steps)", "Step 6",
                 f"{change['lr_recipe']:.3e}", f"{min_lr:.3e}", "--set optim.decay_steps=3"):
        assert text in warnings[0], (text, warnings[0])


def test_bad_recipe_fails_before_training(tiny_data, runs_dir):
    done = run_train(base_overrides(runs_dir, tiny_data, "bad") + ["parallel.data=2"], check=False)
    assert done.returncode != 0
    assert "parallel.data: tensor 2 x pipeline 1 x data 2 = 4 ranks, but the world size is 2" in done.stderr
