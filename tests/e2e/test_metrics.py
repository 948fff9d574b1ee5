"""The job's console and metrics, without a run: what goes to wandb, the end-of-run summary.
Runs of the tiny recipe check them in place (test_train.py: the reference run's output)."""

import math

import pytest


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_wandb_gets_metrics_not_timestamps(one_rank, tmp_path):
    """A train record's wall-clock time stays in metrics.jsonl; wandb plots the elapsed seconds."""
    from cce_parallel.train.metrics import MetricsLogger, read_metrics

    logged = []
    logger = MetricsLogger(tmp_path, {}, wandb_mode="disabled", wandb_project="p", run_name="r")
    logger.wandb = type("Run", (), {"log": lambda self, values, step: logged.append((step, values))})()
    logger.record("train", step=3, loss=6.5, time=1.8e9, elapsed_s=12.5, update=True, peak_mem_per_rank=[1, 2])
    logger.record("eval", step=3, val_loss=6.4, val_ppl=math.exp(6.4))
    logger.wandb = None
    logger.close()
    assert logged == [(3, {"train/loss": 6.5, "train/elapsed_s": 12.5}),
                      (3, {"eval/val_loss": 6.4, "eval/val_ppl": math.exp(6.4)})]
    assert read_metrics(tmp_path / "metrics.jsonl")["train"][3]["time"] == 1.8e9


def test_end_summary_says_what_the_run_did(tmp_path):
    from cce_parallel.train.metrics import end_summary

    common = {"name": "tiny", "steps": 50, "tokens_per_step": 512, "run_dir": tmp_path}
    lines = end_summary(finished=True, step=50, start_step=30, elapsed_s=41.25, train_s=30.5,
                        train={"step": 50, "loss": 6.0}, val={"step": 50, "val_loss": 5.9, "val_ppl": math.exp(5.9)},
                        checkpoint="runs/tiny/checkpoints/step_0000050", **common).splitlines()
    assert lines == [
        f"tiny finished: step 50 of 50, {50 * 512:,} tokens (20 steps, {20 * 512:,} tokens this start); "
        "41.2 s since the start, 30.5 s of it in steps",
        f"  train loss 6.0000 | ppl {math.exp(6.0):.2f} (step 50)",
        f"  val loss 5.9000 | val ppl {math.exp(5.9):.2f} (step 50)",
        "  checkpoint runs/tiny/checkpoints/step_0000050",
        f"  metrics {tmp_path / 'metrics.jsonl'}",
    ]
    nothing = end_summary(finished=False, step=10, start_step=10, elapsed_s=3.0, train_s=0.0, train=None, val=None,
                          checkpoint=None, **common)
    assert nothing.splitlines()[:3] == [
        f"tiny stopped: step 10 of 50, {10 * 512:,} tokens (0 steps, 0 tokens this start); 3.0 s since the start, "
        "0.0 s of it in steps", "  no step trained this start", "  no checkpoint"]
