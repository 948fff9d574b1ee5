"""Checkpoints: model, optimizer, scheduler, data position and RNG states, written atomically.

Layout of ``<dir>/step_0000040/`` (one directory per checkpoint):

    meta.json                 step, consumed samples, parallel layout, scheduler state, recipe
    model_tp{t}_pp{p}.pt      by data-parallel rank 0 of each (tp, pp) coordinate: the model
                              chunks' state dicts (the weights in the model's dtype)
    optim_tp{t}_pp{p}.pt      by data-parallel rank 0: the optimizer (replicated over data parallelism)
    optim_rank{r}.pt          instead, with the distributed optimizer: every rank's shard
    rng_rank{r}.pt            every rank: python, numpy, torch (and CUDA + Megatron tracker) RNGs

The optimizer is saved as what its torch optimizers hold: their state dicts (Adam moments, step
counts, hyperparameters) and the values of their parameters, which are the main weights: the
model's own parameters in fp32 runs, megatron's fp32 copies with bf16, or this rank's shard of
them under the distributed optimizer. Restoring both the model weights and the main weights
makes a resumed step bitwise the uninterrupted one (on CPU; GPUs add their own nondeterminism).

Every rank writes into ``.tmp_step_0000040``; after a barrier rank 0 renames it to
``step_0000040`` and then replaces ``latest`` (a one-line file naming it) through a temporary
file and ``os.replace``. A crash at any point leaves ``latest`` naming a complete checkpoint.
Resuming needs the same parallel layout (tp, pp, dp); the format is per-rank torch.save files,
not a resharding format.
"""

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cce_parallel.train.engine import inner_optimizers

FORMAT = 1
LATEST = "latest"


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint ``latest`` names in directory, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def _coords():
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _is_distributed_optimizer(optimizer) -> bool:
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(type(m).__name__ == "DistributedOptimizer" for m in members)


def _optimizer_state(optimizer) -> list[dict]:
    return [
        {"state_dict": inner.state_dict(),
         "main_params": [p.detach().cpu().clone() for group in inner.param_groups for p in group["params"]]}
        for inner in inner_optimizers(optimizer)
    ]


def _load_optimizer_state(optimizer, saved: list[dict]):
    inners = inner_optimizers(optimizer)
    if len(inners) != len(saved):
        raise ValueError(f"the checkpoint holds {len(saved)} optimizers, this run has {len(inners)}")
    for inner, item in zip(inners, saved):
        inner.load_state_dict(item["state_dict"])
        params = [p for group in inner.param_groups for p in group["params"]]
        for param, value in zip(params, item["main_params"], strict=True):
            param.copy_(value)


def save(directory, *, step: int, consumed_samples: int, engine, meta: dict, keep: int = 0) -> Path:
    """Write a checkpoint of the current state (collective: every rank calls it)."""
    directory = Path(directory)
    final = directory / step_name(step)
    tmp = directory / f".tmp_{step_name(step)}"
    rank = dist.get_rank()
    tp, pp, dp = _coords()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()

    if dp == 0:
        torch.save([_unwrap(chunk).state_dict() for chunk in engine.model], tmp / f"model_tp{tp}_pp{pp}.pt")
    optim_file = _optim_file(engine.optimizer, tp, pp, rank)
    if dp == 0 or _is_distributed_optimizer(engine.optimizer):
        torch.save(_optimizer_state(engine.optimizer), tmp / optim_file)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        record = dict(meta, format=FORMAT, step=step, consumed_samples=consumed_samples,
                      scheduler=engine.scheduler.state_dict(), time=time.time())
        (tmp / "meta.json").write_text(json.dumps(record, indent=1, default=str))
    dist.barrier()

    if rank == 0:
        stale = directory / f".old_{step_name(step)}"
        if final.exists():  # an earlier save of this step (a run restarted from an older checkpoint)
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
        pointer = directory / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, directory / LATEST)
        if keep > 0:
            for old in sorted(directory.glob("step_*"))[:-keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


@torch.no_grad()  # copies into parameters
def load(path, *, engine, layout: dict) -> dict:
    """Restore the state saved in checkpoint `path` into engine (collective); returns its meta."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    saved = meta.get("layout", {})
    if any(saved.get(k) != layout[k] for k in ("tp", "pp", "dp")):
        raise ValueError(
            f"checkpoint {path} was written with tp={saved.get('tp')} pp={saved.get('pp')} dp={saved.get('dp')}; "
            f"this run has tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}. Resuming needs the same layout"
        )
    tp, pp, _dp = _coords()
    rank = dist.get_rank()
    chunks = torch.load(path / f"model_tp{tp}_pp{pp}.pt", map_location="cpu", weights_only=False)
    for chunk, chunk_state in zip(engine.model, chunks, strict=True):
        _unwrap(chunk).load_state_dict(chunk_state)
    saved = torch.load(path / _optim_file(engine.optimizer, tp, pp, rank), map_location="cpu", weights_only=False)
    _load_optimizer_state(engine.optimizer, saved)
    engine.scheduler.load_state_dict(meta["scheduler"])
    _set_rng_state(torch.load(path / f"rng_rank{rank}.pt", map_location="cpu", weights_only=False))
    dist.barrier()
    return meta


def _optim_file(optimizer, tp: int, pp: int, rank: int) -> str:
    return f"optim_rank{rank}.pt" if _is_distributed_optimizer(optimizer) else f"optim_tp{tp}_pp{pp}.pt"


def _unwrap(chunk):
    """The module under megatron's DDP / the CPU LocalDDP (Float16Module stays: its state dict
    is the GPTModel's, under the prefix ``module.``)."""
    return chunk.module
