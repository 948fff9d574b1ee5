"""spawn(worker, world_size): run a worker in one process group of world_size processes; and
run_entry_point(argv, nproc): the train job's ranks (``python -m cce_parallel.train``) as torchrun
would start them, without torchrun.

Each process joins a process group (gloo on CPU, NCCL with one GPU per rank) through a file store
in a fresh temporary directory (no port to race for), calls ``worker(rank, world_size, report,
*args)`` and sends back what it reports. A worker checks many cases in one group, because
spawning a process with torch imported costs seconds; ``report.started(name)`` before each case
tells the parent where a hang happened, ``report.result(name, value)`` hands back anything
picklable (a failure message, measured errors).

The parent waits at most ``timeout`` seconds in all, and ``grace`` seconds after a rank has died,
then kills what is left: a hang or a rank stuck in a collective fails the test instead of blocking
CI. Collectives themselves time out after ``collective_timeout`` seconds (gloo and NCCL honour the
process group's timeout), so a rank waiting for a dead peer errors out and says so.

On a CPU machine (gloo) the ranks are forked from a multiprocessing fork server that imported torch,
triton, cce_parallel and megatron-core once per test process: a rank then starts in a fraction
of a second instead of re-importing them (about 2 CPU-s for torch, 4 more with megatron-core). The
server only imports (no Python thread, no process group, no OpenMP pool yet), so forking it is as
safe as a DataLoader worker's fork. It holds the environment of its start (after
tests/conftest.py set TRITON_INTERPRET=1), not a later os.environ. Where CUDA is present, every
rank is spawned afresh (forking()). Children find the test modules through the parent's
sys.path.

run_entry_point forks the train job's ranks from the same server (which imported the trainer
too), each with torchrun's variables in its environment, so that a CPU training run costs its
steps rather than three interpreters' start-up (torchrun's and two ranks': about 13 CPU-s). It is
for the tests that check what a run computes (tests/e2e). What torchrun itself does (a plain
start's re-launch, signals, its grace, a killed agent) is tested through torchrun.
"""

import contextlib
import dataclasses
import datetime
import importlib
import os
import queue as queue_lib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.interpreter import skip_nested_patching


class Reporter:
    """Passed to the worker: sends (kind, rank, name, value) messages to the parent."""

    def __init__(self, queue, rank: int):
        self._queue = queue
        self.rank = rank

    def started(self, name: str):
        self._queue.put(("started", self.rank, name, None))

    def result(self, name: str, value=None):
        self._queue.put(("result", self.rank, name, value))


@dataclasses.dataclass
class RankOutcome:
    rank: int
    exitcode: int | None = None
    results: dict = dataclasses.field(default_factory=dict)  # name -> reported value, in order
    error: str | None = None  # traceback of an exception that escaped the worker
    last_started: str | None = None
    finished: bool = False  # the worker returned normally
    killed: bool = False


@dataclasses.dataclass
class GroupOutcome:
    world_size: int
    ranks: list
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.finished and r.exitcode == 0 for r in self.ranks)

    def describe(self, limit: int = 6000) -> str:
        """What went wrong with the group itself (dead ranks, hangs, escaped exceptions)."""
        lines = [
            f"process group of {self.world_size} ({self.seconds:.0f} s)"
            + (" TIMED OUT" if self.timed_out else "")
        ]
        for r in self.ranks:
            state = "ok" if r.finished and r.exitcode == 0 else "FAILED"
            extra = " (killed)" if r.killed else ""
            lines.append(
                f"  rank {r.rank}: {state}, exit code {r.exitcode}{extra}, last case started: {r.last_started}"
            )
            if r.error:
                lines.append("    " + r.error.strip().replace("\n", "\n    "))
        text = "\n".join(lines)
        return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]

    def results(self, rank: int = 0) -> dict:
        return self.ranks[rank].results

    def merged(self) -> dict:
        """name -> {rank: value} over all ranks, in first-reported order."""
        out = {}
        for r in self.ranks:
            for name, value in r.results.items():
                out.setdefault(name, {})[r.rank] = value
        return out


def _entry(rank, world_size, backend, init_file, collective_timeout, fn, args, queue):
    report = Reporter(queue, rank)
    code = 0
    skip_nested_patching()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # All ranks are on this host: talk over loopback, whatever the hostname resolves to.
            if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            # Several ranks share few cores: fewer threads each avoid oversubscription.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        fn(rank, world_size, report, *args)
        queue.put(("finished", rank, None, None))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put(("error", rank, None, traceback.format_exc()))
        code = 1
    finally:
        if code == 0 and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    # Flush the queue before leaving; skip interpreter teardown (gloo/NCCL threads may linger).
    queue.close()
    queue.join_thread()
    os._exit(code)


# What the fork server imports once (missing ones are skipped): what the gloo workers and the
# train job's ranks use.
_PRELOAD = ["tests.dist", "cce_parallel.parallel", "megatron.core", "cce_parallel.train.__main__",
            "cce_parallel.train.trainer"]


def forking() -> bool:
    """Whether ranks fork from the fork server: in a CPU test run (the Triton interpreter) on a
    machine without CUDA. Where CUDA is present, importing megatron-core and the trainer may start
    it in the server, and a forked rank then cannot use it: there every rank is spawned afresh."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def _context(backend: str):
    if backend == "nccl" or not forking():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts: on first use
    return ctx


def spawn(
    fn,
    world_size: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    collective_timeout: float = 120.0,
    grace: float = 20.0,
) -> GroupOutcome:
    """Run fn(rank, world_size, report, *args) in world_size new processes; collect reports.

    fn must be importable by name (a module-level function). Never raises for worker failures:
    check GroupOutcome.ok and the reported results.
    """
    ctx = _context(backend)
    queue = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="cce_dist_")
    init_file = os.path.join(tmp, "store")
    outcomes = [RankOutcome(rank) for rank in range(world_size)]
    procs = []
    start = time.monotonic()
    timed_out = False
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_entry,
                args=(rank, world_size, backend, init_file, collective_timeout, fn, args, queue),
                daemon=True,
            )
            p.start()
            procs.append(p)
        first_death = None

        def drain(block_s: float):
            try:
                msg = queue.get(timeout=block_s)
            except queue_lib.Empty:
                return False
            kind, rank, name, value = msg
            o = outcomes[rank]
            if kind == "started":
                o.last_started = name
            elif kind == "result":
                o.results[name] = value
            elif kind == "error":
                o.error = value
            elif kind == "finished":
                o.finished = True
            return True

        while any(p.is_alive() for p in procs):
            drain(0.2)
            now = time.monotonic()
            dead_bad = [o for o, p in zip(outcomes, procs) if not p.is_alive() and p.exitcode != 0]
            if dead_bad or any(o.error for o in outcomes):
                first_death = first_death or now
            if now - start > timeout:
                timed_out = True
                break
            if first_death is not None and now - first_death > grace:
                break
        while drain(0.05):
            pass
    finally:
        for o, p in zip(outcomes, procs):
            if p.is_alive():
                p.kill()
                o.killed = True
            p.join(timeout=10)
            o.exitcode = p.exitcode
        while True:
            try:
                kind, rank, name, value = queue.get_nowait()
            except (queue_lib.Empty, OSError, ValueError):
                break
            if kind == "result":
                outcomes[rank].results[name] = value
            elif kind == "error":
                outcomes[rank].error = value
            elif kind == "finished":
                outcomes[rank].finished = True
        queue.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return GroupOutcome(world_size, outcomes, time.monotonic() - start, timed_out)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_megatron_rank():
    """This process as a world of one (gloo) with megatron-core's model-parallel state at TP 1 x
    PP 1: for building and running a GPTModel in the test process itself."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# -- the train job's ranks ------------------------------------------------------------------------

# torchrun's wait between stopping the other ranks (SIGTERM) and killing them (its default).
_SHUTDOWN_S = 30.0


def _entry_point_rank(main, argv, environ, cwd, stdout, stderr):
    """One rank: torchrun's environment, the run's output files on fds 1 and 2, sys.argv, then
    main() (module:function), whose return value (None: 0) is the exit status."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    module, name = main.split(":")
    module = importlib.import_module(module)
    sys.argv = [module.__file__, *argv]
    try:
        code = getattr(module, name)() or 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash: its traceback, as the interpreter prints it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as cce_parallel/train/__main__.py's ranks leave


def run_entry_point(argv, nproc: int, *, env: dict, cwd, timeout: float,
                    main: str = "cce_parallel.train.__main__:main"):
    """``torchrun --standalone --nproc-per-node=nproc -m cce_parallel.train *argv`` on CPU, with the
    ranks forked (spawned where CUDA is present: forking()), or another entry point's main
    (module:function, reading sys.argv): a subprocess.CompletedProcess whose stdout and stderr are
    the ranks' together, as torchrun's are, and whose returncode is torchrun's (1 if a rank
    failed). As torchrun does, the first rank that fails stops the others: SIGTERM, then SIGKILL
    after _SHUTDOWN_S. Raises subprocess.TimeoutExpired after timeout seconds (the ranks killed)."""
    port = free_port()
    ctx = _context("gloo")
    tmp = tempfile.mkdtemp(prefix="cce_ranks_")
    stdout, stderr = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    for path in (stdout, stderr):
        open(path, "w").close()
    procs = []
    try:
        for rank in range(nproc):
            environ = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}
            environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks
            args = (main, list(argv), environ, str(cwd), stdout, stderr)
            p = ctx.Process(target=_entry_point_rank, args=args)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        stop_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(["run_entry_point", *argv], timeout)
            if stop_at is None and any(p.exitcode not in (None, 0) for p in procs):
                stop_at = now + _SHUTDOWN_S
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)
            if stop_at is not None and now > stop_at:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        with open(stdout) as out, open(stderr) as err:
            outputs = out.read(), err.read()
        shutil.rmtree(tmp, ignore_errors=True)
    code = 0 if all(p.exitcode == 0 for p in procs) else 1
    return subprocess.CompletedProcess(["run_entry_point", *argv], code, *outputs)
