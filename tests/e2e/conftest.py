"""End-to-end runs of the real entry point (gloo, CPU) on the tiny recipe: under torchrun, or with
its ranks forked as torchrun starts them (run_train; tests/dist.py says why).

The dataset is prepared once per test run (``tiny_data``) and every run points at it. The
reference run (``tiny_reference``: the tiny recipe at TP=2, all 50 steps) is made once per test
run too, also under pytest-xdist (tests/shared.py), and shared by the tests that compare against
it. Runs are subprocesses; a test fails with the run's output on error.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist import forking, run_entry_point
from tests.helpers import child_pythonpath
from tests.shared import build_once, worker_copy

ROOT = Path(__file__).resolve().parents[2]
DATA_NAME = "stdlib-bpe-1024"
CACHE_NAME = "megatron_cache"  # cce_parallel.data.prepare.CACHE_NAME: the runs' sample-index cache


def train_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(ROOT)
    env.pop("CCE_PARALLEL_KERNEL_CONFIG", None)  # the trainer's CPU defaults, as a user gets them
    env.setdefault("WANDB_MODE", "disabled")
    env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def train_command(overrides, *, nproc: int | None = 2, recipe: str | None = None) -> list[str]:
    """The entry point under torchrun with nproc ranks, or plain ``python -m`` with nproc=None."""
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "cce_parallel.train"]
    if recipe:
        cmd += ["--recipe", recipe]
    return cmd + ["--set", *overrides]


def run_train(overrides, *, nproc: int | None = 2, timeout: float = 300, env=None, check=True, recipe=None,
              torchrun=False):
    """A run of the entry point, to its end: nproc ranks, or a plain ``python -m`` start with
    nproc=None. On a CPU machine the ranks are forked as torchrun would start them (tests/dist.py:
    run_entry_point), unless torchrun=True: for tests of torchrun's part (its exit status, its
    stopping the other ranks) and for environments a fork cannot take (a sitecustomize)."""
    env = env or train_env()
    start = time.monotonic()
    if nproc is not None and not torchrun and forking() and env.get("TRITON_INTERPRET") == "1":
        argv = (["--recipe", recipe] if recipe else []) + ["--set", *overrides]
        done = run_entry_point(argv, nproc, env=env, cwd=ROOT, timeout=timeout)
    else:
        done = subprocess.run(train_command(overrides, nproc=nproc, recipe=recipe), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    done.seconds = time.monotonic() - start
    if check and done.returncode != 0:
        pytest.fail(f"training run failed (exit {done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}")
    return done


def kill_after_checkpoint(overrides, run_dir: Path, *, min_step: int, env=None, timeout: float = 240, poll: float = 0.05):
    """Start a torchrun run and SIGKILL it, torchrun and every rank as a node failure would, once it
    has a checkpoint and has logged step min_step: (the last step logged, the run's output)."""
    proc = subprocess.Popen(
        train_command(overrides), cwd=ROOT, env=env or train_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        killed_at = wait_for_checkpoint_and_step(run_dir, min_step, [proc], timeout=timeout, poll=poll)
    finally:
        # The ranks first: torchrun starts its workers in sessions of their own, so killing its
        # process group would leave them running.
        for pid in reversed([proc.pid, *_descendants(proc.pid)]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output = proc.communicate(timeout=30)[0]
    if killed_at is None:
        pytest.fail(f"the run never got past step {min_step} (exit {proc.returncode}):\n{output[-4000:]}")
    return killed_at, output


def wait_for_checkpoint_and_step(run_dir: Path, min_step: int, procs, *, timeout: float, poll: float = 0.05):
    """Poll run_dir until it has a checkpoint and its metrics.jsonl has logged step min_step: the
    last step logged then, or None if any of procs exited or timeout seconds passed first."""
    from cce_parallel.train.metrics import read_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(proc.poll() is None for proc in procs):
        path = run_dir / "metrics.jsonl"
        try:
            steps = read_metrics(path)["train"] if path.exists() else {}
        except ValueError:  # caught rank 0 half-way through a line
            steps = {}
        if (run_dir / "checkpoints" / "latest").exists() and max(steps, default=0) >= min_step:
            return max(steps)
        time.sleep(poll)
    return None


def _alive(pid: int) -> bool:
    """pid is a live process (not a zombie waiting for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc), parents before their children."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def base_overrides(tmp_dir: Path, data_dir: Path, name: str) -> list[str]:
    """A run of the tiny recipe on CPU (gloo) even where CUDA is present, as in CI; the GPU tests
    add run.device=cuda after these."""
    return [f"run.out_dir={tmp_dir}", f"run.name={name}", f"data.dir={data_dir}", "run.device=cpu"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The tiny recipe's dataset (stdlib text, 1,024-token BPE), prepared once per test run; under
    xdist each worker runs on its own copy (tests/shared.py: runs write their sample-index cache
    into the dataset's directory)."""

    def build(path: Path):
        from cce_parallel.config import Recipe
        from cce_parallel.train.data import prepare

        recipe = Recipe()
        recipe.data.dir = str(path / DATA_NAME)
        prepare(recipe.data)

    shared = build_once(tmp_path_factory, "tiny-data", build)
    return worker_copy(tmp_path_factory, shared, "tiny-data", ignore=[CACHE_NAME]) / DATA_NAME


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def tiny_reference(tiny_data, tmp_path_factory):
    """The tiny recipe at TP=2 over 2 ranks under torchrun, uninterrupted, with wandb offline, run
    once per test run (whichever xdist worker asks first): (run dir, metrics, the finished run with
    its output and .seconds)."""
    from cce_parallel.train.metrics import read_metrics

    def build(path: Path):
        done = run_train(base_overrides(path, tiny_data, "reference"), env=train_env(WANDB_MODE="offline"),
                         torchrun=True)
        output = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr, "seconds": done.seconds}
        (path / "reference.json").write_text(json.dumps(output))

    path = build_once(tmp_path_factory, "tiny-reference", build)
    output = json.loads((path / "reference.json").read_text())
    done = subprocess.CompletedProcess(None, output["returncode"], output["stdout"], output["stderr"])
    done.seconds = output["seconds"]
    run_dir = path / "reference"
    return run_dir, read_metrics(run_dir / "metrics.jsonl"), done
