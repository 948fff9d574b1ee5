"""The launch scripts parse, and build the torchrun commands they document (CCE_DRY_RUN=1); under
SLURM's signals they pass them on; the launchers' torchrun agent (cce_parallel.train.torchrun)
exits 0 after a clean stop on a signal and gives the ranks the grace their save needs."""

import contextlib
import dataclasses
import importlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["launch/env.sh", "launch/train.sh", "launch/multinode.sh", "launch/slurm.sbatch"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def launch(args, env=None, cwd=ROOT):
    full = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "CCE_", "OMP_", "NCCL_", "RDZV")) and k not in ("TORCHRUN", "MASTER_ADDR", "MASTER_PORT")
    }
    full.update({"CCE_DRY_RUN": "1", "PYTHON": "python"}, **(env or {}))
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
        f"python -m cce_parallel.train.torchrun --standalone --nnodes 1 --nproc-per-node 4 -m cce_parallel.train "
        f"--recipe {recipe} --set train.steps=3"
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
        "python -m cce_parallel.train.torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
        f"--rdzv-endpoint node0:29500 --rdzv-id j7 --max-restarts 0 -m cce_parallel.train --recipe {recipe} --set a=1"
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
        "srun --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 --cpus-per-task 96 python -m cce_parallel.train.torchrun "
        "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu-017:29500 --rdzv-id 4242 --max-restarts 0 "
        f"-m cce_parallel.train --recipe {recipe}"
    )
    assert "[launch] OMP_NUM_THREADS=12" in done.stdout

    # One task per GPU, no torchrun: each task's shell sets its rank from SLURM's task ids.
    done, cmd = launch([str(copy), recipe], env=dict(env, CCE_LAUNCHER="srun"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert shlex.split(cmd) == [
        "srun", "--nodes", "2", "--ntasks-per-node", "8", "--kill-on-bad-exit=1", "--cpus-per-task", "12",
        "bash", "-c", 'export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID"; exec "$@"', "cce-task",
        "python", "-m", "cce_parallel.train", "--recipe", recipe,
    ]
    done, _ = launch([str(copy), recipe], env=dict(env, CCE_LAUNCHER="mpirun"), cwd=tmp_path)
    assert done.returncode == 2 and "CCE_LAUNCHER must be torchrun or srun" in done.stderr


# -- slurm.sbatch under SLURM's signals ----------------------------------------------------------

# srun: runs its command in its own place (same pid), so that a signal sent to srun reaches the
# command, as the real srun forwards SIGUSR1/SIGTERM to its tasks.
SRUN_STUB = """#!/usr/bin/env bash
set -euo pipefail
printf '%s\\n' "$*" >> "$STUB_DIR/srun.args"
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do
    if [[ "$1" == *=* ]]; then shift; else shift 2; fi
done
exec "$@"
"""

# scontrol: records each call, with whether the worker had finished by then; SCONTROL_DELAY
# seconds late with the host names (after touching scontrol.busy), for a signal during set-up.
SCONTROL_STUB = """#!/usr/bin/env bash
set -euo pipefail
finished=no
[ -e "$STUB_DIR/worker.done" ] && finished=yes
printf '%s (worker finished: %s)\\n' "$*" "$finished" >> "$STUB_DIR/scontrol.args"
if [ "$1 $2" = "show hostnames" ]; then
    touch "$STUB_DIR/scontrol.busy"
    sleep "${SCONTROL_DELAY:-0}"
    echo localhost
fi
"""

# The launchers' torchrun agent (cce_parallel.train.torchrun), with the train job
# (-m cce_parallel.train) swapped for WORKER.
TORCHRUN_WRAPPER = """import sys
from cce_parallel.train.torchrun import main

args = sys.argv[1:]
at = args.index("-m")
sys.exit(main(args[:at] + [sys.argv[0].replace("torchrun_wrapper.py", "worker.py")] + args[at + 2:]))
"""

# The train job's part: on SIGUSR1 or SIGTERM it "saves" (1 s), tells its agent it stopped cleanly
# (as the train job does) and exits 0; it gives up after 60 s.
WORKER = """import json, os, signal, sys, time
from pathlib import Path
from cce_parallel.train import grace

out = Path(os.environ["STUB_DIR"])
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
(out / "worker.args").write_text(json.dumps(sys.argv[1:]))
(out / "worker.pid").write_text(str(os.getpid()))
(out / "worker.ready").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
if not got:
    sys.exit(3)
(out / "worker.signal").write_text(" ".join(got))
time.sleep(1.0)
grace.mark_stopped(7, "checkpoints/step_0000007", "signal")
(out / "worker.done").touch()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_job(recipe, tmp_path, **env_extra):
    """slurm.sbatch (a copy, as sbatch runs it) under stub srun/scontrol, with TORCHRUN the real
    torchrun agent running WORKER: (the process, its log)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in [("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)]:
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    for name, text in [("torchrun_wrapper.py", TORCHRUN_WRAPPER), ("worker.py", WORKER)]:
        (tmp_path / name).write_text(text)
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "CCE_", "OMP_", "NCCL_", "RDZV", "PET_", "TORCHELASTIC_", "TORCH_ELASTIC_"))
    }
    env.update({
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_DIR": str(tmp_path),
        "TORCHRUN": f"{sys.executable} {tmp_path / 'torchrun_wrapper.py'}",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "GPUS_PER_NODE": "1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": str(ROOT),
        **env_extra,
    })
    copy = tmp_path / "slurm_script"
    shutil.copy(ROOT / "launch/slurm.sbatch", copy)
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(["bash", str(copy), recipe, "--set", "train.steps=3"], cwd=tmp_path, env=env,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return job, log


def _wait_for(path: Path, job, log: Path, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, f"no {path.name}:\n{log.read_text()}"
        time.sleep(0.05)


def _clean_up(job, tmp_path):
    """Leftovers of a failure: the script's session (srun, torchrun), and the worker, which
    torchrun starts in a session of its own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    pid_file = tmp_path / "worker.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        with contextlib.suppress(OSError):
            if b"worker.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    job.wait(timeout=10)


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_slurm_passes_signals_on_and_requeues_on_usr1(recipe, tmp_path, sig):
    """The batch script under stub srun/scontrol and the real torchrun agent (the launchers' own,
    env.sh's settings) running a stand-in train job: SIGUSR1 to the batch script, as
    --signal=B:USR1@180 sends it, reaches the worker through srun and torchrun; the script waits for
    the worker to finish its "save", then calls `scontrol requeue <job id>` and exits 0. SIGTERM is
    passed on the same way, without a requeue, and the script exits 0: the worker stopped cleanly."""
    job, log = _slurm_job(recipe, tmp_path)
    try:
        _wait_for(tmp_path / "worker.ready", job, log)
        os.kill(job.pid, getattr(signal, f"SIG{sig}"))
        job.wait(timeout=60)
        finished_before_the_script = (tmp_path / "worker.done").exists()
    finally:
        _clean_up(job, tmp_path)

    output = log.read_text()
    assert (tmp_path / "worker.signal").exists(), f"the worker got no signal:\n{output}"
    assert (tmp_path / "worker.signal").read_text() == f"SIG{sig}", output  # once, through torchrun
    assert finished_before_the_script, f"the script exited before the worker had saved:\n{output}"
    assert json.loads((tmp_path / "worker.args").read_text()) == ["--recipe", recipe, "--set", "train.steps=3"]
    srun = (tmp_path / "srun.args").read_text().splitlines()
    assert len(srun) == 1 and srun[0].startswith("--nodes 1 --ntasks-per-node 1 --kill-on-bad-exit=1 "), srun
    assert "--rdzv-id 4242 --max-restarts 0 -m cce_parallel.train" in srun[0]
    assert "[launch] PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in output.splitlines()
    assert "[launch] TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in output.splitlines()
    scontrol = (tmp_path / "scontrol.args").read_text().splitlines()
    assert scontrol[0] == "show hostnames localhost (worker finished: no)"
    assert f"[cce torchrun] SIG{sig}: every rank here (1) saved step 7" in output, output
    assert job.returncode == 0, output
    if sig == "USR1":
        assert scontrol[1:] == ["requeue 4242 (worker finished: yes)"], output
    else:
        assert scontrol[1:] == [], output


# A rank under the launchers' agent (python -m cce_parallel.train.torchrun), as the train job
# behaves: at start-up it tells the agent that a save on a signal takes about 3 s; on SIGTERM it
# "saves" for SAVE_S seconds, then (STUB_MODE=saves) leaves the marker of a clean stop, and exits 0.
AGENT_WORKER = """import os, signal, sys, time
from pathlib import Path
from cce_parallel.train import grace

out = Path(os.environ["STUB_DIR"])
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
grace.report_to_agent(grace.SaveEstimate(bytes=3_000_000, bytes_per_s=1e6, source="the test", asynchronous=False))
(out / f"ready.{os.environ['RANK']}").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
if not got:
    sys.exit(3)
time.sleep(float(os.environ["SAVE_S"]))
if os.environ["STUB_MODE"] == "saves":
    grace.mark_stopped(5, "checkpoints/step_0000005", "signal")
(out / f"done.{os.environ['RANK']}").touch()
"""


@pytest.mark.parametrize("mode", ["saves", "no-marker"])
def test_agent_exit_status_and_grace_after_a_signal(tmp_path, mode):
    """The launchers' agent under SIGTERM to its process group (a scheduler's stop), with a 1 s
    shutdown timeout: it waits for its 2 ranks as long as their estimate says (3 s save: 15 s with
    the margin), not 1 s, so a 2.5 s save finishes; it exits 0 when both left the marker of a
    clean stop, else 128 + 15 (torchrun itself exits 1 either way)."""
    (tmp_path / "worker.py").write_text(AGENT_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_", "CCE_"))}
    env.update(PYTHONPATH=str(ROOT), STUB_DIR=str(tmp_path), STUB_MODE=mode, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1",
               SAVE_S="2.5" if mode == "saves" else "0")
    agent = subprocess.Popen([sys.executable, "-m", "cce_parallel.train.torchrun", "--standalone", "--nproc-per-node=2",
                              str(tmp_path / "worker.py")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0][-3000:]
            time.sleep(0.05)
        os.killpg(agent.pid, signal.SIGTERM)
        signalled = time.monotonic()
        output = agent.communicate(timeout=60)[0]
        after_signal = time.monotonic() - signalled
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
    assert (tmp_path / "done.0").exists() and (tmp_path / "done.1").exists(), output[-3000:]
    if mode == "saves":
        assert agent.returncode == 0, output[-3000:]
        assert after_signal > 2.5  # the save outlasted the 1 s timeout
        if _torchrun_has_shutdown_timeout():  # else torchrun waits its fixed 30 s: nothing to extend
            assert "[cce torchrun] SIGTERM: giving the workers up to 15 s to save and stop" in output, output[-3000:]
        assert "[cce torchrun] SIGTERM: every rank here (2) saved step 5 (checkpoints/step_0000005)" in output
    else:
        assert agent.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "[cce torchrun] SIGTERM: none of the ranks here stopped after a published checkpoint; exit 143" in output


def _torchrun_has_shutdown_timeout() -> bool:
    """torchrun's shutdown timeout is a setting from torch 2.12 on; torch 2.11's waits 30 s."""
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def test_env_defaults_are_what_torchrun_reads():
    """env.sh's signal settings, as the installed torch reads them: torchrun's --signals-to-handle
    (default from PET_SIGNALS_TO_HANDLE) includes SIGUSR1, and its shutdown timeout is 300 s (on a
    torch whose torchrun has that setting)."""
    probe = (
        "from torch.distributed.run import get_args_parser; from torch.distributed.launcher.api import LaunchConfig\n"
        "args = get_args_parser().parse_args(['x.py'])\n"
        "config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)\n"
        "print(args.signals_to_handle, getattr(config, 'shutdown_timeout', 'none'))\n"
    )
    script = f'source launch/env.sh && cce_env_defaults 1 && exec "{sys.executable}" -c "$0"'
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCH_ELASTIC_"))}
    done = subprocess.run(["bash", "-c", script, probe], cwd=ROOT, env=base, capture_output=True, text=True,
                          timeout=60, check=True)
    timeout = "300" if _torchrun_has_shutdown_timeout() else "none"
    assert done.stdout.split() == ["SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", timeout]


def test_slurm_usr1_during_set_up_requeues_without_starting(recipe, tmp_path):
    """SIGUSR1 while the script is still setting up (here: a slow scontrol): no run is started
    (the time limit is near), the job is requeued, and the script exits 0."""
    job, log = _slurm_job(recipe, tmp_path, SCONTROL_DELAY="1")
    try:
        _wait_for(tmp_path / "scontrol.busy", job, log)
        os.kill(job.pid, signal.SIGUSR1)
        job.wait(timeout=30)
    finally:
        _clean_up(job, tmp_path)
    output = log.read_text()
    assert job.returncode == 0, output
    assert not (tmp_path / "srun.args").exists(), output
    assert (tmp_path / "scontrol.args").read_text().splitlines() == [
        "show hostnames localhost (worker finished: no)", "requeue 4242 (worker finished: no)"
    ], output


def test_triton_imported_before_the_cpu_environment_falls_back_to_torch(monkeypatch):
    """On CPU the train job sets TRITON_INTERPRET=1 before megatron.core imports triton. Where
    triton came first, it says so and leaves the variable unset, so that the loss takes torch's
    ops instead of failing in the kernels."""
    from cce_parallel.config import load_recipe
    from cce_parallel.train import launch as train_launch

    pytest.importorskip("triton")  # imported (under the tests' TRITON_INTERPRET=1)
    # The kernels too: imported first by prepare_environment below, with the variable unset, they
    # would be compiled ones for the rest of this process (later CPU tests then fail in them).
    importlib.import_module("cce_parallel.kernels")
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.warns(UserWarning, match="falls back to torch"):
        train_launch.prepare_environment(recipe, "cpu")
    assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.delitem(sys.modules, "triton")  # as if not imported yet (monkeypatch puts it back)
    train_launch.prepare_environment(recipe, "cpu")
    assert os.environ["TRITON_INTERPRET"] == "1"
