"""Checkpoints: model, optimizer, scheduler, data position and RNG states, written atomically,
checked before use, and made of tensors and plain data only.

Each checkpoint ``<dir>/step_0000040/`` is one torch.distributed.checkpoint (DCP) save of tensors,
written by every rank in parallel (``*.distcp`` files and DCP's ``.metadata``), a small JSON file
per state object, and ``meta.json``. The DCP state dict holds:

    tp{t}_pp{p}/model/{chunk}/...   the model chunks' state dicts (weights in the model's dtype),
                                    replicated over data parallelism: DCP writes each tensor once,
                                    the writes spread over the data-parallel ranks
    tp{t}_pp{p}/optim/...           by data-parallel rank 0: the optimizer (replicated over data
                                    parallelism)
    rank{r}/optim/...               instead, with the distributed optimizer: every rank's shard
    rank{r}/rng/...                 every rank: numpy, torch (and CUDA + Megatron tracker) RNGs

Under FSDP (``parallel.fsdp: torch``) the model and optimizer keys are the same, but every
data-parallel rank writes its DTensor shards of them (DCP records each shard's offsets in the
full tensor; data-parallel rank 0 writes the JSON). Loading builds the optimizer's state first
(a step with zero gradients and learning rate 0), so that DCP loads into the live DTensor shards
of the weights and Adam state. DCP reshards on load, so a DDP checkpoint resumes under FSDP and
an FSDP one under DDP (same tp, pp, dp).

Under Megatron-FSDP (``parallel.fsdp: megatron``) every rank writes ``rank{r}/optim`` only: its
shards of the fp32 main weights and Adam state as plain tensors (Megatron-FSDP's shards are
uneven and some are empty, which DTensor's metadata cannot describe without collectives of its
own). The model's bf16 weights are copies of the main weights and are rebuilt from them on load.
Such a checkpoint resumes under Megatron-FSDP with the same layout only (checked).

Keys carry the rank coordinates because DCP treats equal keys on several ranks as one replicated
value: the tensor-parallel shards of a parameter share its name.

The optimizer is saved as what its torch optimizers hold: their state dicts (Adam moments, step
counts, hyperparameters) and the values of their parameters, which are the main weights: the
model's own parameters in fp32 runs, megatron's fp32 copies with bf16, or this rank's shard of
them under the distributed optimizer. Restoring both the model weights and the main weights
makes a resumed step bitwise the uninterrupted one (on CPU; GPUs add their own nondeterminism).
Every tensor of a state object goes into DCP under the object's key; what remains (the nesting,
hyperparameters, python's RNG) is written to ``<key>.json`` (``rank3.rng.json``,
``tp0_pp0.optim.json``) with each tensor replaced by its DCP key, dtype and shape, so its size
follows the number of tensors, not their sizes. Nothing in a checkpoint is unpickled into
objects: tensors are read with ``weights_only``, and DCP's ``.metadata`` through an unpickler that
admits DCP's own metadata classes only.

``meta.json`` (step, consumed samples, parallel layout, scheduler state, recipe) lists the size
and sha256 of every other file and carries the sha256 of its own content. Resuming checks them
all (every rank hashes a share of the files): with ``checkpoint.resume: auto`` a checkpoint that
fails is skipped with a warning naming the bad file, and the newest one that passes is used (with
``checkpoint.keep`` >= 2 there is one to fall back to); a checkpoint named explicitly must pass.

Every rank writes into ``.tmp_step_0000040``, in the background (``Checkpointer``: training waits
only while the state is copied to host memory). Each file is hashed as DCP writes it; once every
rank is done, rank 0 writes meta.json, renames the directory to ``step_0000040`` and then replaces
``latest`` (a one-line file naming it, for people and scripts) through a temporary file and
``os.replace``. A crash or kill at any point, during the background write too, leaves the earlier
checkpoints intact; the next start removes the ``.tmp_`` leftovers. Resuming needs the same
parallel layout (tp, pp, dp): the keys name the coordinates, so the checkpoint does not reshard.

The run directory is locked (``.lock``, an exclusive ``flock`` held by rank 0 while it lives), so
that a second run cannot write into it; the kernel drops the lock when its holder dies, even by
SIGKILL, so a killed run never blocks its own restart.
"""

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import pickle
import random
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.tensor import DTensor

from cce_parallel.train.engine import inner_optimizers

FORMAT = 3  # 1: per-rank torch.save files; 2: DCP with pickled optimizer state; 3: DCP tensors + JSON, checksums
LATEST = "latest"
META = "meta.json"
LOCK = ".lock"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def checkpoints(directory) -> list[Path]:
    """The checkpoint directories (``step_*``) in directory, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob("step_*") if p.is_dir()), reverse=True)


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint ``latest`` names in directory, or None (not checked: see ``verify``)."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    return Path(directory) / pointer.read_text().strip()


# -- integrity --------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_meta(path) -> dict:
    """meta.json of checkpoint path, after checking its own checksum and format."""
    file = Path(path) / META
    try:
        meta = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    except (OSError, ValueError) as err:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"{file} is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} is corrupt (not a JSON object)")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} has format {meta.get('format')}; this version reads format {FORMAT}")
    if meta.get("sha256") != _meta_digest(meta):
        raise CheckpointError(f"{file} is corrupt (its content does not match its sha256)")
    return meta


def verify(path, *, share: tuple[int, int] = (0, 1)) -> dict:
    """meta.json of checkpoint path once it and the files it lists check out (size and sha256);
    share=(i, n) checks only every n-th file from the i-th. Raises CheckpointError naming the
    first bad file."""
    path = Path(path)
    meta = read_meta(path)
    names = sorted(meta["files"])[share[0]::share[1]]
    for name in names:
        file, expected = path / name, meta["files"][name]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing") from None
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes, {expected['bytes']} were written (truncated or replaced)")
    # hashlib releases the GIL on large buffers: the files hash in parallel, one thread each.
    with ThreadPoolExecutor(max_workers=min(len(names), writer_threads()) or 1) as pool:
        digests = list(pool.map(lambda name: _sha256(path / name), names))
    for name, digest in zip(names, digests):
        if digest != meta["files"][name]["sha256"]:
            raise CheckpointError(f"{path / name} is corrupt (sha256 mismatch)")
    return meta


def verify_collective(path) -> dict:
    """``verify`` with the files shared out over the ranks (collective): every rank gets the
    same meta.json, or raises the same CheckpointError."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        meta, problem = verify(path, share=(rank, world)), None
    except CheckpointError as err:
        meta, problem = None, str(err)
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)
    return meta


def newest_valid(directory, warn) -> Path | None:
    """The newest checkpoint in directory that passes ``verify`` (collective), None when there
    is none at all; warn(line) for each one skipped. CheckpointError when none passes."""
    found = checkpoints(directory)
    for path in found:
        try:
            verify_collective(path)
            return path
        except CheckpointError as err:
            warn(f"warning: skipping checkpoint {path.name}: {err}")
    if found:
        raise CheckpointError(f"none of the {len(found)} checkpoints in {directory} is valid (see the warnings)")
    return None


# -- the run directory lock -----------------------------------------------------------------


def lock_run_dir(run_dir) -> int:
    """Take the run directory's lock for this process (its file descriptor: keep it open) or
    raise CheckpointError naming the holder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 256).decode(errors="replace").strip() or "a process that has not written its pid yet"
        os.close(fd)
        raise CheckpointError(f"{run_dir} is in use by another run ({holder}, lock {run_dir / LOCK})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
    return fd


# -- state <-> tensors + JSON -----------------------------------------------------------------


def _encode(obj, key: str, tensors: dict):
    """obj as JSON data; its tensors (and numpy arrays) go into tensors under keys below key."""
    if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.numel() == 0:
        # Nothing to store (Megatron-FSDP leaves some ranks empty shards of a parameter).
        return {"empty": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach()
        return {"tensor": key, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, np.ndarray):
        # torch has no full support for wide unsigned integers (numpy's RNG state is uint32).
        wide_unsigned = obj.dtype.kind == "u" and obj.dtype.itemsize > 1
        data = torch.from_numpy(np.ascontiguousarray(obj.astype(np.int64) if wide_unsigned else obj))
        return {"ndarray": _encode(data, key, tensors), "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):  # e.g. Transformer Engine's FusedAdam keeps its state dtypes
        return {"torch_dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, list):
        return [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, dict) and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
        return {"dict": [[k, _encode(v, f"{key}/{k}", tensors)] for k, v in obj.items()]}
    raise TypeError(f"{key}: a {type(obj).__name__} cannot go into a checkpoint (tensors and plain data only)")


def _decode(doc, tensors: dict):
    if isinstance(doc, list):
        return [_decode(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "tensor" in doc:
        return tensors[doc["tensor"]]
    if "empty" in doc:
        return torch.empty(doc["shape"], dtype=_dtype(doc["empty"]))
    if "ndarray" in doc:
        return _decode(doc["ndarray"], tensors).numpy().astype(np.dtype(doc["dtype"]))
    if "tuple" in doc:
        return tuple(_decode(v, tensors) for v in doc["tuple"])
    if "torch_dtype" in doc:
        return _dtype(doc["torch_dtype"])
    return {k: _decode(v, tensors) for k, v in doc["dict"]}


def _templates(doc, out: dict) -> dict:
    """Empty tensors for the tensor entries of doc that out lacks, to load into (DCP loads in place)."""
    if isinstance(doc, list):
        for v in doc:
            _templates(v, out)
    elif isinstance(doc, dict):
        if "tensor" in doc:
            if doc["tensor"] not in out:
                out[doc["tensor"]] = torch.empty(doc["shape"], dtype=_dtype(doc["dtype"]))
        else:
            for v in doc.values():
                _templates(v, out)
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint")
    return dtype


def _json_name(key: str) -> str:
    return key.replace("/", ".") + ".json"


_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: admit DCP's metadata classes and the torch values they
    hold, nothing that could run code."""

    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        source = {"torch": torch, dcp_metadata.__name__: dcp_metadata}.get(module)
        found = getattr(source, name, None) if source is not None else None
        if isinstance(found, torch.dtype) or (isinstance(found, type) and found.__module__ == dcp_metadata.__name__):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        file = Path(self.path) / ".metadata"
        with open(file, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
                raise CheckpointError(f"{file} is unreadable ({err})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnly(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        # DCP would torch.load(weights_only=False) a non-tensor value.
        raise CheckpointError(f"{read_item.dest_index.fqn} is not a tensor; checkpoints hold tensors only")


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


def _optimizer_state(optimizer, fsdp: str = "none") -> list[dict]:
    """What the checkpoint holds of the optimizer: its torch optimizers' state dicts and main
    weights; under Megatron-FSDP (fsdp="megatron") this rank's shards of them, as plain tensors."""
    state = [
        {"state_dict": inner.state_dict(),
         "main_params": [p.detach() for group in inner.param_groups for p in group["params"]]}
        for inner in inner_optimizers(optimizer)
    ]
    return _local(state) if fsdp == "megatron" else state


def _load_optimizer_state(optimizer, saved: list[dict], *, loaded_in_place: bool = False):
    """Restore the saved optimizer state. loaded_in_place (Megatron-FSDP): DCP has already loaded
    every tensor into this rank's shards; only the param groups' hyperparameters and non-tensor
    state remain (load_state_dict would replace the DTensor states by the plain shards)."""
    inners = inner_optimizers(optimizer)
    if len(inners) != len(saved):
        raise ValueError(f"the checkpoint holds {len(saved)} optimizers, this run has {len(inners)}")
    for inner, item in zip(inners, saved):
        if loaded_in_place:
            _restore_untensored(inner, item["state_dict"])
            continue
        inner.load_state_dict(item["state_dict"])
        params = [p for group in inner.param_groups for p in group["params"]]
        for param, value in zip(params, item["main_params"], strict=True):
            param.copy_(value)


def _fsdp(engine) -> str:
    """How the model is sharded: "torch" (FSDP2: the parameters and optimizer state are DTensor
    shards), "megatron" (Megatron-FSDP: likewise, in buffers of its own) or "none"."""
    from megatron.core.distributed import TorchFullyShardedDataParallel

    for chunk in engine.model:
        if isinstance(chunk, TorchFullyShardedDataParallel):
            return "torch"
        if getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False):
            return "megatron"
    return "none"


def _local(obj):
    """obj with every DTensor replaced by this rank's shard (a view of it)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def _restore_untensored(inner, saved_dict: dict):
    """The param groups' hyperparameters and the non-tensor state of a torch optimizer."""
    for group, saved_group in zip(inner.param_groups, saved_dict["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    params = [p for group in inner.param_groups for p in group["params"]]
    for index, entries in saved_dict["state"].items():
        plain = {k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)}
        inner.state[params[int(index)]].update(plain)


def _init_optimizer_state(optimizer, *, skip_empty: bool = False):
    """Create the state of optimizers that have taken no step yet (zero gradients, lr 0; Adam's
    moments and step are then overwritten by the checkpoint), so that under FSDP their DTensor
    shards exist for DCP to load into. skip_empty: not for parameters whose shard on this rank is
    empty (Megatron-FSDP gives them no gradient, so training gives them no state)."""
    for inner in inner_optimizers(optimizer):
        if inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if skip_empty:
            params = [p for p in params if _local(p).numel() > 0]
        lrs = [group["lr"] for group in inner.param_groups]
        for param in params:
            param.grad = torch.zeros_like(param)
        for group in inner.param_groups:
            group["lr"] = 0.0
        inner.step()
        for group, lr in zip(inner.param_groups, lrs):
            group["lr"] = lr
        for param in params:
            param.grad = None


def _optim_key(optimizer, tp: int, pp: int, rank: int) -> str:
    return f"rank{rank}/optim" if _is_distributed_optimizer(optimizer) else f"tp{tp}_pp{pp}/optim"


def _model_state(engine, tp: int, pp: int) -> dict:
    state = {}
    for i, chunk in enumerate(engine.model):
        for name, value in _unwrap(chunk).state_dict().items():
            if isinstance(value, torch.Tensor):
                state[f"tp{tp}_pp{pp}/model/{i}/{name}"] = value
            elif value is not None:  # megatron's local layers have _extra_state None: nothing to save
                raise TypeError(f"model state {name}: a {type(value).__name__}; checkpoints hold tensors only")
    return state


class _HashingStream:
    """A file DCP writes into, hashed on the way (sha256): the checkpoint's digests cost no second
    read of the files. DCP only appends (write, tell, fsync, close); a seek would break the hash,
    so it marks the digest unusable and the file is hashed by reading it back instead."""

    def __init__(self, raw):
        self.raw, self.digest, self.size, self.usable = raw, hashlib.sha256(), 0, True

    def write(self, data) -> int:
        self.digest.update(data)  # releases the GIL for large buffers: DCP's writer threads hash in parallel
        self.size += memoryview(data).nbytes
        return self.raw.write(data)

    def seek(self, *args):
        self.usable = False
        return self.raw.seek(*args)

    def __getattr__(self, name):  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording {file name: {bytes, sha256}} of every file it writes."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, dict] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        if stream.usable:
            with self._lock:
                self.digests[Path(path).name] = {"bytes": stream.size, "sha256": stream.digest.hexdigest()}


class _Writer(FileSystemWriter):
    """DCP's file writer (its files hashed as written, see _HashingFileSystem) that also stages:
    ``async_save`` copies the state into host buffers through ``stage`` before it returns.

    The host buffers persist from save to save, so a save's blocking time is one device-to-host
    copy. Their first use would cost as much again: a fresh host page is slow to get (on 4x H200,
    52 GB of new pages, pinned or not, took 17-21 s against 0.4-1.3 s for a copy into pages already
    in use). So ``prepare`` allocates and touches them in a thread of its own once the state
    exists (after the first step), while training goes on. They are plain pageable memory: pinning
    them cost as much again the first time, to save under 1 s a copy."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()
        self._host: tuple[dict, dict] | None = None  # (shapes and dtypes by key, the buffers)
        self._allocating: threading.Thread | None = None

    def prepare(self, state_dict: dict):
        """Start allocating host buffers shaped like state_dict (its tensors are not read)."""
        if self._host is not None or self._allocating is not None:
            return
        layout = {k: (v.shape, v.dtype) for k, v in state_dict.items()}

        def allocate():
            host = _create_cpu_state_dict(state_dict)
            for value in host.values():
                (value._local_tensor if isinstance(value, DTensor) else value).zero_()  # fault the pages in
            self._host = (layout, host)

        self._allocating = threading.Thread(target=allocate, name="checkpoint-host-buffers", daemon=True)
        self._allocating.start()

    def stage(self, state_dict: dict) -> dict:
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        layout = {k: (v.shape, v.dtype) for k, v in state_dict.items()}
        if self._host is None or self._host[0] != layout:
            self._host = (layout, _create_cpu_state_dict(state_dict))
        return _copy_state_dict(state_dict, self._host[1])


def writer_threads() -> int:
    """DCP writer threads (and files) per rank: the host's cores shared by its ranks, at most 8."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // max(local, 1)))


class Checkpointer:
    """Writes the run's checkpoints in the background (collective: every rank makes one and calls
    it at the same steps; ``save`` then ``wait`` for a blocking save).

    ``save`` blocks while the state is staged to host memory (buffers reused from save to save,
    see _Writer), then DCP's ``async_save`` writes it from a thread of its own: every rank its share
    (replicated tensors are written once, the writes balanced over the ranks that hold them),
    in ``writer_threads()`` files per rank, each hashed as it is written. When all ranks are done,
    the same thread gathers the digests, and rank 0 writes meta.json, renames the directory into
    place and updates ``latest``. Until that rename the checkpoint is a ``.tmp_`` directory that
    resuming ignores: a kill during the background write leaves the previous checkpoint the newest
    valid one. The next ``save``, ``wait`` (end of the run, a signal) or ``close`` waits for the
    one before; ``poll`` reports a finished one without waiting.
    """

    def __init__(self, directory, *, keep: int = 0, timeout: datetime.timedelta | None = None):
        self.directory, self.keep = Path(directory), keep
        # A gloo group of its own: the background thread's collectives must not interleave with
        # the training's on the default group (NCCL on GPUs, gloo on CPU); DCP needs a CPU group.
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.rank = dist.get_rank()
        self._writer = _Writer(self.directory, thread_count=writer_threads(), sync_files=True)
        self._fs = self._writer.fs
        self._pending: Future | None = None
        if self.rank == 0:  # the leftovers of saves that a kill interrupted
            for stale in list(self.directory.glob(".tmp_step_*")) + list(self.directory.glob(".old_step_*")):
                shutil.rmtree(stale, ignore_errors=True)

    def prepare(self, engine):
        """Allocate the host buffers of later saves in the background (call once the optimizer
        has its state, i.e. after the first step)."""
        self._writer.prepare(_state_to_save(engine)[0])

    def save(self, *, step: int, consumed_samples: int, engine, meta: dict) -> float:
        """Start a checkpoint of the current state; returns the seconds training was blocked."""
        start = time.perf_counter()
        self.wait()
        report = {"step": step, "path": str(self.directory / step_name(step)), "start": start}
        tmp = self.directory / f".tmp_{step_name(step)}"
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier(group=self.group)
        tensors, docs = _state_to_save(engine)
        for key, doc in docs.items():
            (tmp / _json_name(key)).write_text(json.dumps(doc))
        # What meta.json records of this moment; the scheduler moves on while the files are written.
        record = dict(meta, format=FORMAT, step=step, consumed_samples=consumed_samples,
                      scheduler=engine.scheduler.state_dict(), time=time.time())
        record = json.loads(json.dumps(record, default=str))  # the digest is of what the file holds
        self._fs.digests = {}
        staged = time.perf_counter()
        written = dcp.async_save(tensors, checkpoint_id=str(tmp), storage_writer=self._writer, process_group=self.group)
        now = time.perf_counter()
        report.update(stage_s=now - staged, blocked_s=now - start)
        done: Future = Future()
        written.add_done_callback(lambda future: self._finish(future, done, tmp, record, report))
        self._pending = done
        return report["blocked_s"]

    def _finish(self, written: Future, done: Future, tmp: Path, record: dict, report: dict):
        """After DCP's write, in its thread: gather the digests, then rank 0 writes meta.json and
        renames the checkpoint into place. Every rank ends with the same outcome in `done`."""
        problem, digests = None, {}
        try:
            written.result()
            digests = dict(self._fs.digests)
            report["write_s"] = time.perf_counter() - report["start"] - report["blocked_s"]
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            problem = f"rank {self.rank}: the checkpoint write failed ({type(err).__name__}: {err})"
        try:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, (problem, digests), group=self.group)
            problems = [p for p, _ in gathered if p]
            if not problems and self.rank == 0:
                try:
                    known = {name: d for _, part in gathered for name, d in part.items()}
                    report.update(self._publish(tmp, record, known))
                except Exception as err:  # noqa: BLE001
                    problems = [f"rank 0: publishing {tmp} failed ({type(err).__name__}: {err})"]
            outcome = [problems, report]
            dist.broadcast_object_list(outcome, src=dist.get_global_rank(self.group, 0), group=self.group)
            problems, report = outcome
            if problems:
                raise CheckpointError(f"checkpoint of step {record['step']} not written: " + "; ".join(problems))
            report["total_s"] = time.perf_counter() - report["start"]
            done.set_result(report)
        except Exception as err:  # noqa: BLE001 - the waiting thread raises it
            done.set_exception(err)

    def _publish(self, tmp: Path, record: dict, known: dict) -> dict:
        """Rank 0: meta.json (digests of every file: as written where the writer hashed it, else
        read back), then the atomic rename and ``latest``, then pruning to ``keep``."""
        hashed = time.perf_counter()
        files = {}
        for file in sorted(p for p in tmp.iterdir() if p.is_file()):
            size = file.stat().st_size
            digest = known.get(file.name)
            files[file.name] = digest if digest and digest["bytes"] == size else {"bytes": size, "sha256": _sha256(file)}
        record = dict(record, files=files)
        record["sha256"] = _meta_digest(record)
        (tmp / META).write_text(json.dumps(record, indent=1))
        _fsync_dir(tmp)
        final = self.directory / tmp.name.removeprefix(".tmp_")
        stale = self.directory / f".old_{final.name}"
        if final.exists():  # an earlier save of this step (a run restarted from an older checkpoint)
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
        pointer = self.directory / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.directory / LATEST)
        _fsync_dir(self.directory)
        published = time.perf_counter()
        if self.keep > 0:
            for old in sorted(self.directory.glob("step_*"))[:-self.keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        return {"bytes": sum(f["bytes"] for f in files.values()), "publish_s": published - hashed,
                "prune_s": time.perf_counter() - published, "read_back": sorted(n for n in files if n not in known)}

    def poll(self) -> dict | None:
        """The report of a save that has finished since the last call (raises its error), else None."""
        if self._pending is not None and self._pending.done():
            return self.wait()
        return None

    def wait(self) -> dict | None:
        """Wait for the save in flight; its report (step, path, bytes, blocked_s, write_s, ...) or None."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self):
        """Wait for the save in flight, then release the group."""
        try:
            self.wait()
        finally:
            dist.destroy_process_group(self.group)


def _fsync_dir(path: Path):
    """Make a rename or a new file in path durable (the files themselves are fsynced by DCP)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_to_save(engine) -> tuple[dict, dict]:
    """(tensors for DCP, {key: JSON document}) of this rank's share of the state."""
    rank = dist.get_rank()
    tp, pp, dp = _coords()
    tensors, docs = {}, {}
    docs[f"rank{rank}/rng"] = _encode(_rng_state(), f"rank{rank}/rng", tensors)
    # Every data-parallel rank offers its replica of the model under the same keys: DCP writes each
    # such tensor once, the writes spread over those ranks. A replicated optimizer (no distributed
    # optimizer) comes from data-parallel rank 0 alone: offered by every rank, its 12 bytes per
    # parameter would be staged in host memory on every rank. Under FSDP2 every data-parallel rank
    # holds a shard of each tensor (DTensors: DCP writes each shard under the shared key), and
    # data-parallel rank 0 writes the JSON, which records the full shapes. Under Megatron-FSDP every
    # rank writes its own optimizer shards (main weights included) as plain tensors; the model's
    # bf16 weights are copies of those main weights, rebuilt on load.
    fsdp = _fsdp(engine)
    sharded = fsdp == "torch"
    if fsdp != "megatron":
        tensors.update(_model_state(engine, tp, pp))
    if dp == 0 or sharded or _is_distributed_optimizer(engine.optimizer):
        key = _optim_key(engine.optimizer, tp, pp, rank)
        doc = _encode(_optimizer_state(engine.optimizer, fsdp), key, tensors)
        if dp == 0 or not sharded:
            docs[key] = doc
    return tensors, docs


def save(directory, *, step: int, consumed_samples: int, engine, meta: dict, keep: int = 0) -> Path:
    """Write a checkpoint of the current state and wait for it (collective: every rank calls it)."""
    saver = Checkpointer(directory, keep=keep)
    try:
        saver.save(step=step, consumed_samples=consumed_samples, engine=engine, meta=meta)
    finally:
        saver.close()
    return Path(directory) / step_name(step)


@torch.no_grad()  # copies into parameters
def load(path, *, engine, layout: dict) -> dict:
    """Restore the state saved in checkpoint `path` into engine (collective); returns its meta.
    The files are not hashed here: ``verify_collective`` checks them before."""
    path = Path(path)
    meta = read_meta(path)
    saved = meta.get("layout", {})
    if any(saved.get(k) != layout[k] for k in ("tp", "pp", "dp")):
        raise ValueError(
            f"checkpoint {path} was written with tp={saved.get('tp')} pp={saved.get('pp')} dp={saved.get('dp')}; "
            f"this run has tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}. Resuming needs the same layout"
        )
    fsdp = _fsdp(engine)
    saved_fsdp = meta.get("recipe", {}).get("parallel", {}).get("fsdp", "none")
    if (saved_fsdp == "megatron") != (fsdp == "megatron"):
        raise ValueError(
            f"checkpoint {path} was written with parallel.fsdp={saved_fsdp}; "
            f"this run has parallel.fsdp={fsdp}. "
            "A Megatron-FSDP checkpoint holds each rank's own shards: it resumes under Megatron-FSDP only, "
            "and Megatron-FSDP resumes from its own checkpoints only"
        )
    tp, pp, _dp = _coords()
    rank = dist.get_rank()
    rng_key, optim_key = f"rank{rank}/rng", _optim_key(engine.optimizer, tp, pp, rank)
    docs = {}
    for key in (rng_key, optim_key):
        try:
            docs[key] = json.loads((path / _json_name(key)).read_bytes())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path / _json_name(key)} is unreadable ({err})") from None
    # DCP loads in place into a template of the same keys: the model's own state dict (every data-
    # parallel rank reads the copy data-parallel rank 0 wrote) and empty tensors shaped as saved.
    state = _model_state(engine, tp, pp) if fsdp != "megatron" else {}
    if fsdp != "none":
        # Shards to load into: the optimizer's own state (DCP loads in place), then the saved
        # document's tensor entries resolve to them.
        _init_optimizer_state(engine.optimizer, skip_empty=fsdp == "megatron")
        live = _optimizer_state(engine.optimizer, fsdp)
        if fsdp == "megatron":
            mine = {}
            _encode(live, optim_key, mine)
            saved_keys = set(_templates(docs[optim_key], {}))
            if set(mine) != saved_keys:
                raise CheckpointError(
                    f"{path / _json_name(optim_key)}: the optimizer state does not match this rank's shards "
                    f"({len(saved_keys)} tensors saved, {len(mine)} here)"
                )
            state.update(mine)
        else:
            _encode(live, optim_key, state)
    for doc in docs.values():
        _templates(doc, state)
    dcp.load(state, storage_reader=_SafeReader(path), planner=_TensorsOnly())
    for i, chunk in enumerate(engine.model):
        if fsdp == "megatron":
            chunk.module.install_optimized_model_weights()  # fp32 main weights -> bf16 weights
            continue
        prefix, module = f"tp{tp}_pp{pp}/model/{i}/", _unwrap(chunk)
        own = module.state_dict()  # with its None entries
        own.update({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        module.load_state_dict(own)
    saved_optimizer = _decode(docs[optim_key], state)
    _load_optimizer_state(engine.optimizer, saved_optimizer, loaded_in_place=fsdp == "megatron")
    engine.scheduler.load_state_dict(meta["scheduler"])
    _set_rng_state(_decode(docs[rng_key], state))
    dist.barrier()
    return meta


def _unwrap(chunk):
    """The module under megatron's DDP / the CPU LocalDDP (Float16Module stays: its state dict
    is the GPTModel's, under the prefix ``module.``)."""
    return chunk.module
