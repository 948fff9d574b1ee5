"""The launch scripts parse, and build the torchrun commands they document (CCE_DRY_RUN=1)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["launch/env.sh", "launch/train.sh", "launch/multinode.sh", "launch/slurm.sbatch"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def launch(args, env=None, cwd=ROOT):
    full = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CCE_", "OMP_", "NCCL_", "RDZV"))
    }
    full.update({"CCE_DRY_RUN": "1"}, **(env or {}))
    done = subprocess.run(
        ["bash", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=30, check=False
    )
    command = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("[launch] ") and "=" not in line.split()[1]
    ]
    return done, (command[-1].removeprefix("[launch] ") if command else None)


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("{}\n")
    return str(path)


@pytest.mark.parametrize("script", SCRIPTS)
def test_syntax(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def test_executable_bits():
    for script in ("launch/train.sh", "launch/multinode.sh", "launch/slurm.sbatch"):
        assert os.access(ROOT / script, os.X_OK), script


def test_train_one_node(recipe):
    done, cmd = launch(["launch/train.sh", "4", recipe, "--set", "train.steps=3"])
    assert done.returncode == 0, done.stderr
    assert cmd == (
        f"torchrun --standalone --nnodes 1 --nproc-per-node 4 -m cce_parallel.train --recipe {recipe} "
        "--set train.steps=3"
    )
    assert "[launch] CUDA_DEVICE_MAX_CONNECTIONS=1" in done.stdout
    assert "[launch] TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in done.stdout


def test_train_cpu_hides_gpus_and_respects_exports(recipe):
    done, cmd = launch(["launch/train.sh", "cpu:2", recipe], env={"OMP_NUM_THREADS": "3"})
    assert done.returncode == 0, done.stderr
    assert "--nproc-per-node 2" in cmd
    assert "[launch] CUDA_VISIBLE_DEVICES=" in done.stdout.splitlines()
    assert "[launch] CCE_PARALLEL_DEVICE=cpu" in done.stdout
    assert "[launch] OMP_NUM_THREADS=3" in done.stdout  # an export wins over the default


@pytest.mark.parametrize(
    "args, message",
    [
        (["0", "RECIPE"], "NGPUS must be"),
        (["two", "RECIPE"], "NGPUS must be"),
        (["2", "missing.yaml"], "does not exist"),
        (["2"], "launch/train.sh NGPUS RECIPE"),
    ],
)
def test_train_bad_arguments(recipe, args, message):
    done, _ = launch(["launch/train.sh", *[recipe if a == "RECIPE" else a for a in args]])
    assert done.returncode == 2 and message in done.stderr


def test_multinode(recipe):
    done, cmd = launch(
        ["launch/multinode.sh", "2", "8", "node0:29500", recipe, "--set", "a=1"], env={"RDZV_ID": "j7"}
    )
    assert done.returncode == 0, done.stderr
    assert cmd == (
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id j7 "
        f"--max-restarts 0 -m cce_parallel.train --recipe {recipe} --set a=1"
    )
    done, _ = launch(["launch/multinode.sh", "2", "8", "node0", recipe])
    assert done.returncode == 2 and "HOST:PORT" in done.stderr


def test_slurm(recipe, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho gpu-017\necho gpu-018\n")
    (fake / "scontrol").chmod(0o755)
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[017-018]",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_GPUS_PER_NODE": "h100:8",
        "SLURM_CPUS_ON_NODE": "96",
    }
    # sbatch runs a copy of the script from elsewhere: it must find the repository by the submit dir.
    copy = tmp_path / "slurm_script"
    shutil.copy(ROOT / "launch/slurm.sbatch", copy)
    done, cmd = launch([str(copy), recipe], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert cmd == (
        "srun --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 --cpus-per-task 96 torchrun --nnodes 2 "
        "--nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu-017:29500 --rdzv-id 4242 --max-restarts 0 "
        f"-m cce_parallel.train --recipe {recipe}"
    )
    assert "[launch] OMP_NUM_THREADS=12" in done.stdout
