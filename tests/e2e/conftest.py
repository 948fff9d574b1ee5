"""End-to-end runs of the real entry point under torchrun (gloo, CPU) on the tiny recipe.

The dataset is prepared once per session (``tiny_data``) and every run points at it. The
reference run (``tiny_reference``: the tiny recipe at TP=2, all 50 steps) is shared by the tests
that compare against it. Runs are subprocesses; a test fails with the run's output on error.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def train_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
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


def run_train(overrides, *, nproc: int | None = 2, timeout: float = 300, env=None, check=True):
    start = time.monotonic()
    done = subprocess.run(
        train_command(overrides, nproc=nproc), cwd=ROOT, env=env or train_env(), capture_output=True, text=True,
        timeout=timeout, check=False,
    )
    done.seconds = time.monotonic() - start
    if check and done.returncode != 0:
        pytest.fail(f"training run failed (exit {done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}")
    return done


def base_overrides(tmp_dir: Path, data_dir: Path, name: str) -> list[str]:
    return [f"run.out_dir={tmp_dir}", f"run.name={name}", f"data.dir={data_dir}"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The tiny recipe's dataset (stdlib text, 1,024-token BPE), prepared once."""
    from cce_parallel.config import Recipe
    from cce_parallel.train.data import prepare

    data_dir = tmp_path_factory.mktemp("data") / "stdlib-bpe-1024"
    recipe = Recipe()
    recipe.data.dir = str(data_dir)
    prepare(recipe.data)
    return data_dir


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def tiny_reference(tiny_data, runs_dir):
    """The tiny recipe at TP=2 over 2 ranks, uninterrupted, with wandb offline: (run dir, metrics, seconds)."""
    from cce_parallel.train.metrics import read_metrics

    done = run_train(base_overrides(runs_dir, tiny_data, "reference"), env=train_env(WANDB_MODE="offline"))
    run_dir = runs_dir / "reference"
    return run_dir, read_metrics(run_dir / "metrics.jsonl"), done
