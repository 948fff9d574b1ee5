"""Checkpoints: model, optimizer, scheduler, data position and RNG states, written atomically.

Each checkpoint ``<dir>/step_0000040/`` is one torch.distributed.checkpoint (DCP) save, written
by every rank in parallel (``*.distcp`` files and DCP's ``.metadata``), plus ``meta.json`` (step,
consumed samples, parallel layout, scheduler state, recipe). The DCP state dict holds:

    tp{t}_pp{p}/model/{chunk}/...   tensors, by data-parallel rank 0 of each (tp, pp) coordinate:
                                    the model chunks' state dicts (weights in the model's dtype)
    tp{t}_pp{p}/optim               by data-parallel rank 0: the optimizer (replicated over data
                                    parallelism), serialized
    rank{r}/optim                   instead, with the distributed optimizer: every rank's shard
    rank{r}/rng                     every rank: python, numpy, torch (and CUDA + Megatron tracker) RNGs

Keys carry the rank coordinates because DCP treats equal keys on several ranks as one replicated
value: the tensor-parallel shards of a parameter share its name.

The optimizer is saved as what its torch optimizers hold: their state dicts (Adam moments, step
counts, hyperparameters) and the values of their parameters, which are the main weights: the
model's own parameters in fp32 runs, megatron's fp32 copies with bf16, or this rank's shard of
them under the distributed optimizer. Restoring both the model weights and the main weights
makes a resumed step bitwise the uninterrupted one (on CPU; GPUs add their own nondeterminism).

Every rank writes into ``.tmp_step_0000040``; after a barrier rank 0 renames it to
``step_0000040`` and then replaces ``latest`` (a one-line file naming it) through a temporary
file and ``os.replace``. A crash at any point leaves ``latest`` naming a complete checkpoint.
Resuming needs the same parallel layout (tp, pp, dp): the keys name the coordinates, so the
checkpoint does not reshard.
"""

import io
import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state

from cce_parallel.train.engine import inner_optimizers

FORMAT = 2  # 1: per-rank torch.save files; 2: torch.distributed.checkpoint
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


def _pack(obj) -> bytes:
    # Non-tensor state (optimizer moments and step counts, RNG tuples) goes in as one serialized
    # value per key: DCP stores such values as bytes and needs no template of their structure.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _optim_key(optimizer, tp: int, pp: int, rank: int) -> str:
    return f"rank{rank}/optim" if _is_distributed_optimizer(optimizer) else f"tp{tp}_pp{pp}/optim"


def _model_state(engine, tp: int, pp: int) -> dict:
    return {f"tp{tp}_pp{pp}/model": {str(i): _unwrap(chunk).state_dict() for i, chunk in enumerate(engine.model)}}


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

    state = {f"rank{rank}/rng": _pack(_rng_state())}
    if dp == 0:
        state.update(_model_state(engine, tp, pp))
    if dp == 0 or _is_distributed_optimizer(engine.optimizer):
        state[_optim_key(engine.optimizer, tp, pp, rank)] = _pack(_optimizer_state(engine.optimizer))
    dcp.save(state, checkpoint_id=str(tmp))
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
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}; this version reads format {FORMAT}")
    saved = meta.get("layout", {})
    if any(saved.get(k) != layout[k] for k in ("tp", "pp", "dp")):
        raise ValueError(
            f"checkpoint {path} was written with tp={saved.get('tp')} pp={saved.get('pp')} dp={saved.get('dp')}; "
            f"this run has tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}. Resuming needs the same layout"
        )
    tp, pp, _dp = _coords()
    rank = dist.get_rank()
    optim_key = _optim_key(engine.optimizer, tp, pp, rank)
    # DCP loads in place into a template of the same keys: the model's own state dict (every data-
    # parallel rank reads the copy data-parallel rank 0 wrote) and placeholders for the bytes.
    state = {f"rank{rank}/rng": b"", optim_key: b""}
    state.update(_model_state(engine, tp, pp))
    dcp.load(state, checkpoint_id=str(path))
    chunks = state[f"tp{tp}_pp{pp}/model"]
    for i, chunk in enumerate(engine.model):
        _unwrap(chunk).load_state_dict(chunks[str(i)])
    _load_optimizer_state(engine.optimizer, _unpack(state[optim_key]))
    engine.scheduler.load_state_dict(meta["scheduler"])
    _set_rng_state(_unpack(state[f"rank{rank}/rng"]))
    dist.barrier()
    return meta


def _unwrap(chunk):
    """The module under megatron's DDP / the CPU LocalDDP (Float16Module stays: its state dict
    is the GPTModel's, under the prefix ``module.``)."""
    return chunk.module
