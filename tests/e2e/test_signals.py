"""Preemption and background checkpoints, end to end on CPU (tiny recipe, TP=2 over gloo):

- SIGTERM to one rank at some step: all ranks save after the next step (a lean checkpoint: a
  quarter smaller here) and exit 0, and a restart continues bitwise as the uninterrupted run, to
  a last checkpoint that exports as the uninterrupted run's;
- SIGTERM to the process group of ``python -m cce_parallel.train``, as a scheduler sends it: the
  checkpoint, and the command exits 0 (torchrun's own agent would exit 1);
- train.exit_duration: the run stops with a checkpoint before its wall-clock budget ends, exit 0;
- a kill while a checkpoint is still being written leaves the one before as the newest valid one;
- the signal deadline and a second signal exit at once.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, _descendants, base_overrides, run_train, train_command, train_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _losses(metrics, steps):
    return [metrics["train"][s]["loss"] for s in steps]


def _start(command, env=None):
    return subprocess.Popen(command, cwd=ROOT, env=env or train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(proc, ready, timeout=240, poll=0.05):
    """Poll ready() until it is true; fail with the run's output if the run ends or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) first:\n{proc.communicate()[0][-4000:]}")
        time.sleep(poll)
    _kill_all(proc)
    pytest.fail(f"timed out:\n{proc.communicate()[0][-4000:]}")


def _kill_all(proc):
    for pid in reversed([proc.pid, *_descendants(proc.pid)]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _last_step(run_dir: Path) -> int:
    from cce_parallel.train.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    return max(read_metrics(path)["train"], default=0) if path.exists() else 0


def _ranks(proc) -> list[int]:
    """The pids of torchrun's workers (processes below it that run the train job)."""
    pids = []
    for pid in _descendants(proc.pid):
        with contextlib.suppress(OSError):
            if b"cce_parallel.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def test_sigterm_on_one_rank_saves_at_the_next_step_and_resumes(tiny_reference, tiny_data, runs_dir, tmp_path):
    """SIGTERM to one rank only (a signal reaches ranks at different times): both ranks agree on
    the step after it, save it (lean: without the weights that the optimizer holds), and exit 0,
    so torchrun exits 0; a restart resumes from that checkpoint and computes the uninterrupted
    run's losses bit for bit, and its last checkpoint exports as the uninterrupted run's does. The
    run starts from the uninterrupted run's step-40 checkpoint (checkpoint.resume names it), so
    that it trains 10 steps rather than 50."""
    from cce_parallel.train.checkpoint import CheckpointError, verify
    from cce_parallel.train.metrics import read_metrics

    reference_dir, reference, _ = tiny_reference
    run_dir = runs_dir / "sigterm"
    overrides = base_overrides(runs_dir, tiny_data, "sigterm") + ["checkpoint.interval=0"]
    full = reference_dir / "checkpoints" / "step_0000040"
    proc = _start(train_command(overrides + [f"checkpoint.resume={full}"]))
    try:
        _wait_for(proc, lambda: _last_step(run_dir) >= 42)
        ranks = _ranks(proc)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        _kill_all(proc)
    assert proc.returncode == 0, output[-4000:]
    assert f"resumed from {full} at step 40" in output
    stopped = [line for line in output.splitlines() if "on a signal, checkpoint written" in line]
    assert stopped, output[-4000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert 42 <= step < 50
    assert output.count("received SIGTERM") == 1  # one rank got it, both stopped
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:07d}"
    assert verify(run_dir / "checkpoints" / f"step_{step:07d}")["step"] == step
    assert _last_step(run_dir) == step

    # The save on a signal is lean: the model's weights, which the optimizer's entries hold (fp32
    # here: its parameters are the model's), are left out; the reference's saves keep them.
    saved = run_dir / "checkpoints" / f"step_{step:07d}"
    lean_bytes, full_bytes = _bytes(saved), _bytes(full)
    assert verify(saved)["model_weights"] == "main_params" and verify(full)["model_weights"] == "model"
    assert 0.7 * full_bytes < lean_bytes < 0.8 * full_bytes, (lean_bytes, full_bytes)  # 4 of 16 bytes a param

    # Resumed from it (checkpoint.resume: auto, the run's own), the run continues bitwise; with
    # checkpoint.lean every save is lean (here the one at the end), and its export is the
    # reference's, from a full save, tensor for tensor.
    done = run_train(overrides + ["checkpoint.lean=true"])
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:07d}'} at step {step}" in done.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = range(41, 51)
    assert _losses(metrics, steps) == _losses(reference, steps)  # bitwise, before the signal and after
    last = run_dir / "checkpoints" / "step_0000050"
    assert verify(last)["model_weights"] == "main_params"
    assert _bytes(last, ".distcp") == _bytes(saved, ".distcp")  # the JSON files' numbers aside
    assert _exported(last, tmp_path / "lean") == _exported(reference_dir / "checkpoints" / "step_0000050",
                                                            tmp_path / "full")

    # The document that maps the weights to their main weights is checked as every file is.
    for damage in ("truncate", "remove"):
        copy = shutil.copytree(saved, tmp_path / damage)
        doc = copy / "tp1_pp0.weights.json"
        if damage == "truncate":
            doc.write_bytes(doc.read_bytes()[:-1])
        else:
            doc.unlink()
        with pytest.raises(CheckpointError, match="tp1_pp0.weights.json"):
            verify(copy)


def _bytes(checkpoint: Path, suffix: str = "") -> int:
    """What a checkpoint's files whose names end in suffix hold (every file by default, meta.json included)."""
    return sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file() and f.name.endswith(suffix))


def _exported(checkpoint: Path, out: Path) -> dict:
    """The export's tensors (fp32, padded vocabulary, no tokenizer), as bytes by name."""
    from safetensors.torch import load_file

    from cce_parallel.hf.export import export

    export(checkpoint, out, keep_padding=True, tokenizer=False)
    return {k: v.numpy().tobytes() for k, v in load_file(str(out / "model.safetensors")).items()}


def test_sigterm_to_the_process_group_of_a_plain_start_exits_0(tiny_data, runs_dir):
    """`python -m cce_parallel.train` for a 2-rank recipe re-launches itself under the job's torchrun
    agent (and says so); SIGTERM to its process group after step 3, as a scheduler stops a job: the
    agent passes it on, every rank saves the next step, and the command exits 0
    (cce_parallel.train.torchrun's EXIT_STOPPED; a bare torchrun raises its SignalException and
    exits 1)."""
    from cce_parallel.train.checkpoint import verify
    from cce_parallel.train.torchrun import EXIT_STOPPED

    run_dir = runs_dir / "sigterm-group"
    overrides = base_overrides(runs_dir, tiny_data, "sigterm-group") + ["checkpoint.interval=0"]
    proc = _start(train_command(overrides, nproc=None))
    try:
        _wait_for(proc, lambda: _last_step(run_dir) >= 3)
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        _kill_all(proc)
    assert proc.returncode == EXIT_STOPPED == 0, output[-4000:]
    assert "not under torchrun: this recipe needs 2 processes" in output
    stopped = [line for line in output.splitlines() if "on a signal, checkpoint written" in line]
    assert stopped, output[-4000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert f"[cce torchrun] SIGTERM: every rank here (2) saved step {step} " in output, output[-4000:]
    assert output.count("received SIGTERM") == 2  # each rank once, from the agent
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:07d}"
    assert verify(run_dir / "checkpoints" / f"step_{step:07d}")["step"] == step


def test_exit_duration_stops_with_a_checkpoint_before_the_budget(tiny_data, runs_dir):
    """train.exit_duration=0.15 (9 s from each rank's start, start-up included): the ranks stop
    together after the last step that leaves time for another step and a save, with a checkpoint
    of it, before the budget ends, and exit 0."""
    from cce_parallel.train.checkpoint import verify
    from cce_parallel.train.metrics import read_metrics

    run_dir = runs_dir / "exit-duration"
    # More steps than 9 s can hold on any machine: the budget, not the last step, ends the run.
    overrides = base_overrides(runs_dir, tiny_data, "exit-duration") + ["checkpoint.interval=0", "eval.interval=0",
                                                                          "train.exit_duration=0.15", "train.steps=1000"]
    done = run_train(overrides)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    (stop,) = metrics["stop"].values()
    assert stop["reason"] == "exit_duration"
    step = stop["step"]
    assert 1 <= step < 1000 and max(metrics["train"]) == step
    assert f"stopped at step {step} (train.exit_duration: 0.15 min would pass before another step" in done.stdout
    # Before the budget, and not long before it (another step and a save take 1-2 s here): the check
    # is against the last step's time and the save's estimate, hence the tolerances. Step 1 only
    # where start-up alone took the budget (a heavily loaded machine).
    assert step == 1 or 9 - 5 < stop["elapsed_s"] < 9 + 3, stop
    assert verify(Path(stop["checkpoint"]))["step"] == step
    print(f"exit_duration: stopped at step {step}, {stop['elapsed_s']:.1f} s in ({done.seconds:.1f} s in all)")


SLOW_PUBLISH = """
import sys, time
from cce_parallel.train import checkpoint

publish = checkpoint.Checkpointer._publish

def stuck_after_the_write(self, tmp, record, known):
    # The files of step 8 are written; a kill now must leave step 4 the newest valid checkpoint.
    if record["step"] >= 8:
        (tmp.parent / "write_done").write_text(str(record["step"]))
        time.sleep(600)
    return publish(self, tmp, record, known)

checkpoint.Checkpointer._publish = stuck_after_the_write
from cce_parallel.train.__main__ import main
sys.exit(main())
"""


def test_kill_during_background_write_keeps_the_previous_checkpoint(tiny_reference, tiny_data, runs_dir, tmp_path):
    """The step-8 checkpoint is written in the background but never published (rank 0 hangs before
    meta.json) while training goes on; SIGKILL then. The restart resumes from step 4, removes the
    unpublished directory, and matches the uninterrupted run bit for bit."""
    from cce_parallel.train.metrics import read_metrics

    _, reference, _ = tiny_reference
    run_dir = runs_dir / "killed-writing"
    ckpt = run_dir / "checkpoints"
    overrides = base_overrides(runs_dir, tiny_data, "killed-writing") + ["checkpoint.interval=4"]
    script = tmp_path / "slow_publish.py"
    script.write_text(textwrap.dedent(SLOW_PUBLISH))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
               "--set", *overrides]
    proc = _start(command)
    try:
        # Training went on past the step-8 save: it did not wait for the write.
        _wait_for(proc, lambda: (ckpt / "write_done").exists() and _last_step(run_dir) >= 10)
        assert (ckpt / ".tmp_step_0000008" / ".metadata").exists()
    finally:
        _kill_all(proc)
        proc.communicate(timeout=30)
    assert (ckpt / "latest").read_text().strip() == "step_0000004"

    done = run_train(overrides + ["train.stop_at=12"])
    assert "resumed from" in done.stdout and "at step 4" in done.stdout, done.stdout[-3000:]
    assert not (ckpt / ".tmp_step_0000008").exists()
    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = range(5, 13)
    assert _losses(metrics, steps) == _losses(reference, steps)  # bitwise
    assert (ckpt / "latest").read_text().strip() == "step_0000012"


def test_signal_deadline_exits_without_a_checkpoint(tiny_data, runs_dir):
    """SIGTERM to torchrun, which forwards it to its ranks; with checkpoint.signal_deadline_s
    shorter than a step, they exit at once (128 + 15), writing nothing."""
    run_dir = runs_dir / "deadline"
    overrides = base_overrides(runs_dir, tiny_data, "deadline") + ["checkpoint.interval=0",
                                                                     "checkpoint.signal_deadline_s=0.01"]
    proc = _start(train_command(overrides))
    try:
        _wait_for(proc, lambda: _last_step(run_dir) >= 2)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        _kill_all(proc)
    assert "the deadline passed: exiting at once, without a checkpoint" in output, output[-4000:]
    assert not (run_dir / "checkpoints" / "latest").exists()


SECOND_SIGNAL = """
import os, signal, time
from cce_parallel.train import signals

signals.SAME_SIGNAL_S = 0.3
stop = signals.StopOnSignal(["SIGUSR1"], None, "cpu")
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGUSR1)  # within SAME_SIGNAL_S: the same signal, forwarded
time.sleep(0.05)
print("noted", stop.first is not None, flush=True)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGUSR1)  # a second signal
time.sleep(5)
print("still running", flush=True)
"""


def test_second_signal_exits_at_once():
    done = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=ROOT, env=train_env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 128 + signal.SIGUSR1, done.stderr
    assert "noted True" in done.stdout and "still running" not in done.stdout
    assert "a second signal (SIGUSR1): exiting at once" in done.stderr
