"""Two nodes for real: two torchrun agents started through launch/multinode.sh, as a user starts
them on two machines, join one c10d rendezvous on localhost. Each "node" runs one process, so the
tiny recipe's tensor-parallel group of 2 spans both. The run is SIGKILLed after a checkpoint, as a
node failure would kill it, restarted with the same command, and its losses are bitwise those of
the one-node run of the same world (tiny_reference)."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    ROOT,
    _alive,
    _descendants,
    base_overrides,
    train_env,
    wait_for_checkpoint_and_step,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]

NODES = 2
INTERVAL = 3  # checkpoints at steps 3, 6 and 8 (train.stop_at saves too)
STOP_AT = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(rdzv_id: str) -> dict:
    env = train_env(TORCHRUN=f"{sys.executable} -m torch.distributed.run", RDZV_ID=rdzv_id)
    for name in ("CCE_DRY_RUN", "RDZV_CONF", "MAX_RESTARTS"):  # the script's knobs: its defaults here
        env.pop(name, None)
    # The reference ran its 2 ranks on this host, and the train job gave each cores // 2 intra-op
    # threads (launch.py: cores over LOCAL_WORLD_SIZE). Here each agent has LOCAL_WORLD_SIZE 1, so
    # its rank would take all the cores: right on real nodes, each with its own, but these two
    # "nodes" share this host. CPU reductions and GEMMs split their work by thread, and the losses
    # then differ in the last bits (on 2 cores: from step 4 on). OpenMP's thread limit gives each
    # rank the reference's team size.
    env["OMP_THREAD_LIMIT"] = str(max(1, (os.cpu_count() or 1) // 2))
    return env


def _start_nodes(port: int, rdzv_id: str, overrides: list[str], logs: Path, name: str, started: list):
    """The same command on every node, as multinode.sh's header says; each agent in a session of
    its own, like processes on separate machines."""
    command = ["bash", "launch/multinode.sh", str(NODES), "1", f"127.0.0.1:{port}", "recipes/tiny.yaml",
               "--set", *overrides]
    agents = []
    for node in range(NODES):
        with open(logs / f"{name}-node{node}.log", "w") as log:
            agents.append(subprocess.Popen(command, cwd=ROOT, env=_node_env(rdzv_id), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
        started.append(agents[-1])
    return agents


def _logs(logs: Path) -> str:
    return "\n".join(f"--- {path.name}:\n{path.read_text()[-3000:]}" for path in sorted(logs.glob("*.log")))


def _kill_all(agents, workers=()):
    """SIGKILL what a failed test leaves: workers first (only pids that still are train workers),
    then the agents."""
    for pid in workers:
        with contextlib.suppress(OSError):
            if _alive(pid) and b"cce_parallel.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    for agent in agents:
        agent.kill()  # a no-op once it has been reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=30)


def test_two_nodes_kill_and_resume_match_one_node(tiny_reference, tiny_data, tmp_path):
    """Two agents (1 process each, TP=2 across them) train to a checkpoint at step 3 and are
    SIGKILLed a step or two later; their workers die with them. The same command started again on
    both "nodes" (same endpoint, same RDZV_ID: the c10d store lived in a killed agent, so nothing of
    the old rendezvous is left; a user reruns what they ran) resumes from step 3 and stops at step
    8. Every loss logged, by either start, is bitwise the one-node run's."""
    from cce_parallel.train.metrics import read_metrics

    _, reference, _ = tiny_reference
    logs = tmp_path / "logs"
    logs.mkdir()
    run_dir = tmp_path / "multinode"
    overrides = base_overrides(tmp_path, tiny_data, "multinode") + [
        f"train.stop_at={STOP_AT}", f"checkpoint.interval={INTERVAL}", "eval.iters=1",
    ]
    port, rdzv_id = _free_port(), f"test-multinode-{os.getpid()}"
    started, workers = [], []
    try:
        # -- first start, killed after its step-3 checkpoint ------------------------------------
        agents = _start_nodes(port, rdzv_id, overrides, logs, "first", started)
        start = time.monotonic()
        killed_at = wait_for_checkpoint_and_step(run_dir, INTERVAL + 1, agents, timeout=300)
        if killed_at is None:
            pytest.fail(f"the two-node run never got past step {INTERVAL + 1}:\n{_logs(logs)}")
        latest_at_kill = (run_dir / "checkpoints" / "latest").read_text().strip()
        workers_of = {agent.pid: _descendants(agent.pid) for agent in agents}
        workers = [pid for pids in workers_of.values() for pid in pids]
        for agent in agents:
            # multinode.sh execs torchrun: the process a user (or srun) signals is the agent itself.
            cmdline = Path(f"/proc/{agent.pid}/cmdline").read_bytes().split(b"\0")
            assert b"torch.distributed.run" in cmdline, cmdline
            assert workers_of[agent.pid], f"agent {agent.pid} runs no worker"
            os.kill(agent.pid, signal.SIGKILL)
        for agent in agents:
            agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "workers outlived their SIGKILLed agents"
        workers = []  # gone: their pids are free for other processes
        first_seconds = time.monotonic() - start

        # -- second start: the same command on both nodes ----------------------------------------
        agents = _start_nodes(port, rdzv_id, overrides, logs, "second", started)
        start = time.monotonic()
        deadline = start + 300
        for agent in agents:
            try:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the restarted two-node run did not finish in 300 s:\n{_logs(logs)}")
        codes = [agent.returncode for agent in agents]
        assert codes == [0] * NODES, f"agents exited with {codes}:\n{_logs(logs)}"
        second_seconds = time.monotonic() - start
    finally:
        running = [agent for agent in started if agent.poll() is None]  # a reaped agent's pid may be reused
        _kill_all(started, workers + [pid for agent in running for pid in _descendants(agent.pid)])

    assert latest_at_kill == f"step_{INTERVAL:07d}", "killed too late to test the resume from step 3"
    assert killed_at > INTERVAL
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert list(metrics["resume"]) == [INTERVAL]
    assert len(metrics["meta"]) == 2
    for meta in metrics["meta"]:
        assert (meta["layout"]["world"], meta["layout"]["tp"], meta["layout"]["dp"]) == (2, 2, 1)
    assert sorted(metrics["train"]) == list(range(1, STOP_AT + 1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STOP_AT:07d}"

    # Every train record of both starts (read_metrics keeps only the last of a step), by start: a
    # start writes its meta record first. Steps 4 to killed_at (or a step more, logged between the
    # last look and the kill) were trained twice, before the kill and after the resume.
    starts = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == "meta":
            starts.append([])
        elif record.get("kind") == "train":
            starts[-1].append(record)
    first, second = starts
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= killed_at
    assert [r["step"] for r in second] == list(range(INTERVAL + 1, STOP_AT + 1))
    for record in first + second:
        step = record["step"]
        assert record["loss"] == reference["train"][step]["loss"], step  # bitwise
        assert record["lr"] == reference["train"][step]["lr"], step
    print(f"two nodes: first start {first_seconds:.1f} s (killed after step {killed_at}), "
          f"second {second_seconds:.1f} s")


# -- launch/slurm.sbatch with CCE_LAUNCHER=srun: one task per GPU, no torchrun ---------------------

# srun: starts --nodes x --ntasks-per-node copies of its command on this host, each with the task
# variables SLURM gives a task (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS), passes
# SIGTERM and SIGUSR1 on to them as srun does, and exits with the first nonzero status.
SRUN_TASKS = """import os, signal, subprocess, sys

args, opts = sys.argv[1:], {}
while args and args[0].startswith("--"):
    if "=" in args[0]:
        key, value = args[0][2:].split("=", 1)
        args = args[1:]
    else:
        key, value, args = args[0][2:], args[1], args[2:]
    opts[key] = value
with open(os.path.join(os.environ["STUB_DIR"], "srun.args"), "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
tasks = []
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                   SLURM_NODEID=str(node), SLURM_NTASKS=str(nodes * per_node))
        tasks.append(subprocess.Popen(args, env=env))


def forward(signum, frame):
    for task in tasks:
        if task.poll() is None:
            task.send_signal(signum)


signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGUSR1, forward)
codes = [task.wait() for task in tasks]
sys.exit(next((code for code in codes if code), 0))
"""

SCONTROL = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$STUB_DIR/scontrol.args"
if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi
"""


def test_slurm_srun_tasks_two_nodes_usr1_requeue_and_resume_match_torchrun(tiny_reference, tiny_data, tmp_path):
    """launch/slurm.sbatch with CCE_LAUNCHER=srun on 2 "nodes" of 1 GPU each (a stand-in srun that
    starts the tasks on this host with SLURM's task variables; the tiny recipe's TP=2 spans both):
    no torchrun, each task is a rank. SIGUSR1 to the batch script after the step-3 checkpoint, as
    --signal=B:USR1@180 sends it: srun passes it to both ranks, which save the next step and exit
    0; the script requeues the job and exits 0. The requeued job (the same script again) resumes
    from that checkpoint and stops at step 8. Every loss of both starts is bitwise torchrun's."""
    from cce_parallel.train.metrics import read_metrics

    _, reference, _ = tiny_reference
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(f"#!{sys.executable}\n{SRUN_TASKS}")
    (stubs / "scontrol").write_text(SCONTROL)
    for stub in ("srun", "scontrol"):
        (stubs / stub).chmod(0o755)
    run_dir = tmp_path / "srun-tasks"
    overrides = base_overrides(tmp_path, tiny_data, "srun-tasks") + [
        f"train.stop_at={STOP_AT}", f"checkpoint.interval={INTERVAL}", "eval.iters=1",
    ]
    env = _node_env("unused")
    for name in ("TORCHRUN", "RDZV_ID", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    env.update(PATH=os.pathsep.join([str(stubs), str(Path(sys.executable).parent), env["PATH"]]), STUB_DIR=str(tmp_path),
               CCE_LAUNCHER="srun", SLURM_NNODES=str(NODES), SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4243",
               SLURM_SUBMIT_DIR=str(ROOT), GPUS_PER_NODE="1", MASTER_PORT=str(_free_port()))
    command = ["bash", "launch/slurm.sbatch", "recipes/tiny.yaml", "--set", *overrides]
    logs = tmp_path / "logs"
    logs.mkdir()
    jobs = []
    try:
        with open(logs / "first.log", "w") as log:
            jobs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True))
        if wait_for_checkpoint_and_step(run_dir, INTERVAL + 1, jobs, timeout=300) is None:
            pytest.fail(f"the srun job never got past step {INTERVAL + 1}:\n{_logs(logs)}")
        os.kill(jobs[0].pid, signal.SIGUSR1)  # to the batch script, as --signal=B:USR1@180
        jobs[0].wait(timeout=120)
        assert jobs[0].returncode == 0, _logs(logs)
        first = (logs / "first.log").read_text()
        stopped = [line for line in first.splitlines() if "on a signal, checkpoint written" in line]
        assert stopped, _logs(logs)
        step = int(stopped[0].split("stopped at step ")[1].split()[0])
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:07d}"
        assert (tmp_path / "scontrol.args").read_text().splitlines() == ["show hostnames localhost", "requeue 4243"]

        with open(logs / "second.log", "w") as log:
            jobs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True))
        jobs[1].wait(timeout=300)
        assert jobs[1].returncode == 0, _logs(logs)
    finally:
        for job in jobs:
            if job.poll() is None:
                _kill_all([job], _descendants(job.pid))
    srun = (tmp_path / "srun.args").read_text().splitlines()
    assert len(srun) == 2 and srun[0].startswith("--nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 bash -c "), srun
    assert "torch.distributed.run" not in "".join(srun) and "cce_parallel.train.torchrun" not in "".join(srun)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert list(metrics["resume"]) == [step]
    for meta in metrics["meta"]:
        assert (meta["layout"]["world"], meta["layout"]["tp"], meta["layout"]["dp"]) == (2, 2, 1)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in records if r.get("kind") == "train"]
    assert sorted({r["step"] for r in trained}) == list(range(1, STOP_AT + 1))
    for record in trained:
        assert record["loss"] == reference["train"][record["step"]]["loss"], record["step"]  # bitwise
