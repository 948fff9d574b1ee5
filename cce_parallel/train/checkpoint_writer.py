"""The background writer, ``Checkpointer``: it stages the state into host buffers kept from save
to save (``_Writer``), writes it with DCP's ``async_save`` from a thread of its own, hashes every
file as it is written (``_HashingFileSystem``), and once every rank is done publishes the
checkpoint atomically (meta.json, rename, ``latest``, pruning to ``keep``). Collective: every
rank makes one and calls it at the same steps. The format is described in checkpoint.py.
"""

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.tensor import DTensor

from cce_parallel.train.checkpoint_files import (
    FORMAT,
    LATEST,
    META,
    CheckpointError,
    json_name,
    _meta_digest,
    _sha256,
    step_name,
    writer_threads,
)
from cce_parallel.train.checkpoint_state import state_to_save


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
        if self._host is not None and all(self._host[0].get(k) == v for k, v in layout.items()):
            # The buffers of these keys (all of them, or a lean save's share: no new pages on a signal)
            return _copy_state_dict(state_dict, {k: self._host[1][k] for k in layout})
        self._host = (layout, _create_cpu_state_dict(state_dict))
        return _copy_state_dict(state_dict, self._host[1])


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
        self._writer.prepare(state_to_save(engine)[0])

    def save(self, *, step: int, consumed_samples: int, engine, meta: dict, lean: bool = False) -> float:
        """Start a checkpoint of the current state; returns the seconds training was blocked.
        lean: leave out the model's weights that the optimizer's main weights hold (see checkpoint.py)."""
        start = time.perf_counter()
        self.wait()
        report = {"step": step, "path": str(self.directory / step_name(step)), "start": start}
        tmp = self.directory / f".tmp_{step_name(step)}"
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier(group=self.group)
        tensors, docs = state_to_save(engine, lean=lean)
        for key, doc in docs.items():
            (tmp / json_name(key)).write_text(json.dumps(doc))
        # What meta.json records of this moment; the scheduler moves on while the files are written.
        record = dict(meta, format=FORMAT, step=step, consumed_samples=consumed_samples,
                      scheduler=engine.scheduler.state_dict(), time=time.time(),
                      model_weights="main_params" if any(k.endswith("/weights") for k in docs) else "model")
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
        read back), then the atomic rename and ``latest``, then pruning to ``keep`` (the report's
        ``pruned``: the checkpoints removed)."""
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
        pruned = []
        if self.keep > 0:
            for old in sorted(self.directory.glob("step_*"))[:-self.keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
                    pruned.append(str(old))
        return {"bytes": sum(f["bytes"] for f in files.values()), "publish_s": published - hashed,
                "prune_s": time.perf_counter() - published, "pruned": pruned,
                "read_back": sorted(n for n in files if n not in known)}

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
