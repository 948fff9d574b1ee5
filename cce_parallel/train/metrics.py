"""Metrics: a console line per logging interval, metrics.jsonl in the run directory, and wandb.

Records of ``metrics.jsonl`` (one JSON object per line; rank 0 writes):
    {"kind": "meta", ...}                         once per start: recipe, layout, sizes, device, versions
    {"kind": "train", "step", "loss", "lr", "grad_norm", "step_time", "tokens_per_s", "mfu",
     "consumed_samples", "tokens", "time", "elapsed_s"}
                                                  every step (time: the wall clock, a timestamp of
                                                  the record, not sent to wandb; elapsed_s: seconds
                                                  since this start of the job); at logging steps also
     "peak_mem_per_rank" (bytes, list by global rank) and "peak_mem_max"
    {"kind": "eval", "step", "val_loss", "val_ppl", "val_tokens"}
    {"kind": "checkpoint_start", "step", "blocked_s", "waited_s"}
                                                  a background save began: training was blocked
                                                  blocked_s, waited_s of it for the save before
    {"kind": "checkpoint", "step", "path", "seconds", "blocked_s", "stage_s", "write_s",
     "publish_s", "prune_s", "pruned", "total_s", "bytes", "write_gb_per_s", "read_back"}
                                                  a checkpoint is complete: bytes of all its files,
                                                  seconds from the save's start (total_s) and its
                                                  parts; write_gb_per_s: bytes over the time after
                                                  training went on; read_back: files hashed by
                                                  reading them (the rest were hashed as written);
                                                  pruned: the older checkpoints removed then
                                                  (checkpoint.keep)
    {"kind": "resume", "step", "path", "verify_s", "load_s"}
                                                  a start that continued from a checkpoint
    {"kind": "schedule_change", "step", "changed", "differs_at", "lr_checkpoint", "lr_recipe", "fix"}
                                                  ... whose recipe gives another learning-rate
                                                  schedule than the checkpoint's: changed {recipe
                                                  key: [checkpoint's, recipe's]}, the first step
                                                  whose lr differs and its lr under each, the
                                                  overrides that keep the old
    {"kind": "stop", "step", "reason", "checkpoint", "elapsed_s", "train_s", "tokens", "train_loss",
     "train_loss_step", "val_loss", "val_loss_step"}
                                                  how training ended: reason "signal",
                                                  "exit_duration", "stop_at" or "done"; the newest
                                                  checkpoint (or null); seconds since the start and
                                                  in steps; tokens trained (every start); the last
                                                  losses of this start (null: none); the console's
                                                  end-of-run summary says the same
    {"kind": "grace_warning", "step", "grace_s", "bytes", "bytes_per_s", "source", "step_s",
     "asynchronous", "on_signal_s", "needed_s"}   the launcher's grace is shorter than a save on a
                                                  signal needs (train/grace.py)
A resumed run appends to the same file; readers keep the last record of each step.

Peak memory is ``torch.cuda.max_memory_allocated`` per rank on GPUs, and the peak resident set
size (``ru_maxrss``) per process on CPU. MFU = achieved model FLOP/s / (world size · peak FLOP/s),
with the peak from logging.peak_tflops or the GPU's name (bf16 dense); none on CPU by default.
"""

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peaks, TFLOP/s, by substring of torch.cuda.get_device_name().
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "B200": 2250.0}


def peak_tflops(configured: float | None, device: str) -> float | None:
    if configured is not None:
        return configured
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def peak_memory_per_rank(device: str) -> list[int]:
    """Peak bytes of every rank (collective), by global rank."""
    if device == "cuda":
        mine = torch.cuda.max_memory_allocated()
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    values = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    values[dist.get_rank()] = float(mine)
    dist.all_reduce(values)
    return [int(v) for v in values.tolist()]


# Record fields that are no metric to plot: the x axis, and a timestamp (wandb keeps its own).
_NOT_METRICS = ("step", "time")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class MetricsLogger:
    """Rank 0 writes the console, metrics.jsonl and wandb; other ranks only join collectives."""

    def __init__(self, run_dir: Path, recipe_dict: dict, *, wandb_mode: str, wandb_project: str, run_name: str):
        self.rank0 = dist.get_rank() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not self.rank0:
            return
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        mode = os.environ.get("WANDB_MODE") or wandb_mode
        if mode != "disabled":
            self.wandb = _start_wandb(Path(run_dir), recipe_dict, mode=mode, project=wandb_project, name=run_name)

    def record(self, kind: str, **fields):
        if not self.rank0:
            return
        fields = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
        self.file.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
        if self.wandb is not None and kind in ("train", "eval"):
            scalars = {
                f"{kind}/{k}": v for k, v in fields.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _NOT_METRICS
            }
            self.wandb.log(scalars, step=fields["step"])

    def print(self, text: str):
        if self.rank0:
            print(text, flush=True)

    def train_line(self, r: dict, total_steps: int):
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        mem = f"{_gib(r['peak_mem_max'])} ({'max over ranks' if r['device'] == 'cuda' else 'RSS, max over ranks'})"
        self.print(
            f"step {r['step']:>6}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | MFU {mfu} | "
            f"peak mem {mem} | {r['step_time'] * 1000:.0f} ms/step"
        )

    def close(self):
        if not self.rank0:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run_dir: Path, recipe_dict: dict, *, mode: str, project: str, name: str):
    try:
        import wandb
    except ImportError:
        print("wandb is not installed: logging to metrics.jsonl only (pip install wandb)", flush=True)
        return None
    id_file = run_dir / "wandb_id"
    if not id_file.is_file():  # one wandb run per run directory, resumed across restarts
        id_file.write_text(f"{name}-{int(time.time())}\n")
    try:
        return wandb.init(
            project=project, name=name, id=id_file.read_text().strip(), resume="allow", dir=str(run_dir),
            mode=mode, config=recipe_dict,
            # Where the run is kept at the start, and no history and summary block at the end: the
            # job prints its own summary (end_summary).
            settings=wandb.Settings(quiet=True),
        )
    except Exception as err:  # noqa: BLE001 - logging must not stop training
        print(f"wandb.init failed ({err}): logging to metrics.jsonl only", flush=True)
        return None


def end_summary(*, name: str, finished: bool, step: int, steps: int, start_step: int, tokens_per_step: int,
                elapsed_s: float, train_s: float, train: dict | None, val: dict | None, checkpoint: str | None,
                run_dir) -> str:
    """The console's lines at the end of a run (this start of it): where it stopped, what it
    trained, how long it took, the last losses and perplexities, and what it leaves."""
    n = step - start_step
    this_start = f" ({n} step{'' if n == 1 else 's'}, {n * tokens_per_step:,} tokens this start)" if start_step else ""
    lines = [f"{name} {'finished' if finished else 'stopped'}: step {step} of {steps}, {step * tokens_per_step:,} tokens{this_start}; "
             f"{elapsed_s:.1f} s since the start, {train_s:.1f} s of it in steps"]
    if train is not None:
        lines.append(f"  train loss {train['loss']:.4f} | ppl {_ppl(train['loss']):.2f} (step {train['step']})")
    else:
        lines.append("  no step trained this start")
    if val is not None:
        lines.append(f"  val loss {val['val_loss']:.4f} | val ppl {val['val_ppl']:.2f} (step {val['step']})")
    lines.append(f"  checkpoint {checkpoint}" if checkpoint else "  no checkpoint")
    lines.append(f"  metrics {Path(run_dir) / 'metrics.jsonl'}")
    return "\n".join(lines)


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0)) if math.isfinite(loss) else math.nan


def read_metrics(path) -> dict:
    """{"meta": [...], "train": {step: record}, "eval": {step: record}, ...} from a metrics.jsonl;
    later records of a step (after a resume) replace earlier ones."""
    out = {"meta": [], "train": {}, "eval": {}, "checkpoint_start": {}, "checkpoint": {}, "resume": {}, "stop": {},
           "grace_warning": {}, "schedule_change": {}}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        kind = record.get("kind")
        if kind == "meta":
            out["meta"].append(record)
        elif kind in out:
            out[kind][record["step"]] = record
    return out
