"""Checkpoint files on disk: the names (``step_0000040``, ``latest``, ``meta.json``, ``.lock``),
``meta.json`` and its checksums, verification before use, the run directory's lock, and reading
DCP's files with nothing unpickled into objects (``SafeReader``, ``TensorsOnly``; ``read_tensors``
in one process, for the export). Functions of paths only: nothing here knows the
engine or writes a checkpoint; ``verify_collective`` and ``newest_valid`` are collectives on the
default group. The format is described in checkpoint.py.
"""

import fcntl
import hashlib
import json
import os
import pickle
import socket
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

FORMAT = 3  # 1: per-rank torch.save files; 2: DCP with pickled optimizer state; 3: DCP tensors + JSON, checksums
LATEST = "latest"
META = "meta.json"
LOCK = ".lock"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def json_name(key: str) -> str:
    """The file of a state object's JSON document (``rank3/rng`` -> ``rank3.rng.json``)."""
    return key.replace("/", ".") + ".json"


SHARD_INDEX_FORMAT = 1  # of rank{r}.shards.json (written by checkpoint_state.py, read by hf/megatron_fsdp.py)


def shard_index_key(rank: int) -> str:
    """Under Megatron-FSDP: the key of rank's shard index (its file ``rank{r}.shards.json``),
    where each of its main-weight shards sits in its parameter (see checkpoint.py)."""
    return f"rank{rank}/shards"


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


def writer_threads() -> int:
    """DCP writer threads (and files) per rank: the host's cores shared by its ranks, at most 8."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // max(local, 1)))


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


# -- reading: tensors, never objects ----------------------------------------------------------


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


class SafeReader(FileSystemReader):
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


class TensorsOnly(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        # DCP would torch.load(weights_only=False) a non-tensor value.
        raise CheckpointError(f"{read_item.dest_index.fqn} is not a tensor; checkpoints hold tensors only")


def read_tensors(path, templates: dict) -> None:
    """Load ``templates`` ({DCP key: tensor of the saved shape and dtype}) in place from the
    checkpoint at ``path``, in this process alone (no process group: the export's reads), through
    ``SafeReader`` and ``TensorsOnly``."""
    with warnings.catch_warnings():
        # torch warns at every load without a process group that it assumes one process: asked for.
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent is to load in a single process")
        dcp.load(templates, storage_reader=SafeReader(str(path)), planner=TensorsOnly(), no_dist=True)
