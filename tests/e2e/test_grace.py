"""The grace a save on a signal needs, and the grace the launcher gives it (train/grace.py,
train/torchrun.py):

- the estimate (a checkpoint's bytes, the write speed earlier saves measured), the grace a
  launcher gives, and the warning where it is too short;
- ``--dry-run`` prints the checkpoint's size and the save's expected time;
- a bare torchrun whose grace is shorter than the save (a slow disk made here) warns, after the
  save that measured it and at the next start-up;
- through the launch script, a save slower than torchrun's grace still publishes after SIGTERM
  (the launchers' agent waits as long as the save needs), and the restart continues from it.

The slow disk is DCP's file system slowed to a given rate, installed by a ``sitecustomize`` in the
ranks (``SLOW_DISK``).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cce_parallel.train import grace
from tests.e2e.conftest import ROOT, _descendants, base_overrides, run_train, train_env

SLOW_DISK = '''
"""The tests' slow disk: in the train job's ranks (RANK set), DCP writes every file at
CCE_TEST_DISK_BYTES_PER_S bytes/s."""
import os

if os.environ.get("RANK") is not None and os.environ.get("CCE_TEST_DISK_BYTES_PER_S"):
    import contextlib
    import time

    from torch.distributed.checkpoint import filesystem

    _rate = float(os.environ["CCE_TEST_DISK_BYTES_PER_S"])
    _create_stream = filesystem.FileSystem.create_stream

    class _SlowStream:
        def __init__(self, raw):
            self.raw = raw

        def write(self, data):
            time.sleep(memoryview(data).nbytes / _rate)
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    @contextlib.contextmanager
    def _slow_create_stream(self, path, mode):
        with _create_stream(self, path, mode) as raw:
            yield _SlowStream(raw) if "w" in mode else raw

    filesystem.FileSystem.create_stream = _slow_create_stream
'''


def _slow_disk_env(tmp_path: Path, bytes_per_s: float | None, **extra) -> dict:
    """train_env with the slow disk (None: a normal one) and no launcher settings of the caller's."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_DISK)
    env = train_env(**extra)
    for name in [k for k in env if k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_", "CCE_", "OMP_"))]:
        del env[name]
    env.pop("TORCHRUN", None)
    env.pop("PYTHON", None)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    if bytes_per_s:
        env["CCE_TEST_DISK_BYTES_PER_S"] = str(bytes_per_s)
    return env


def _records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("kind") == kind:
                out.append(record)
    return out


# -- the estimate, the grace and the check (no training) -------------------------------------------

def test_checkpoint_bytes_and_the_save_estimate(tmp_path):
    """Bytes per parameter in a checkpoint; the write speed is the newest save's (bytes over its
    time from start to publication), else assumed; on a signal a step and up to two saves."""
    assert grace.checkpoint_bytes(1000, 2) == 14_000  # bf16 weights + fp32 main weights + two moments
    assert grace.checkpoint_bytes(1000, 4) == 16_000  # fp32: the optimizer's copy is stored too
    assert grace.checkpoint_bytes(1000, 2, "megatron") == 12_000  # weights rebuilt from the main weights

    fresh = grace.estimate(3e9, run_dir=tmp_path, asynchronous=True)
    assert fresh.bytes_per_s == grace.ASSUMED_BYTES_PER_S and "assumed" in fresh.source
    assert fresh.on_signal_s == pytest.approx(6.0)

    records = [{"kind": "train", "step": 3, "step_time": 0.5},
               {"kind": "checkpoint", "step": 4, "bytes": 2_000_000_000, "total_s": 4.0},
               {"kind": "train", "step": 4, "step_time": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{\"kind\": \"tra")
    measured = grace.estimate(3e9, run_dir=tmp_path, asynchronous=True)
    assert measured.bytes_per_s == 5e8 and measured.source == "measured on the save of step 4"
    assert measured.save_s == 6.0 and measured.on_signal_s == 12.5  # 0.5 + 2 x 6
    assert measured.needed_s == 29  # ceil(1.5 x 12.5 + 10)
    assert grace.estimate(3e9, run_dir=tmp_path, asynchronous=False).on_signal_s == 6.5


def test_the_grace_a_launcher_gives():
    """Our agent says its grace in the environment; a bare torchrun's comes from its command line,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT or its default; no agent, no grace to compare with."""
    assert grace.launcher_grace({}).seconds is None
    mine = grace.launcher_grace({grace.AGENT_GRACE_ENV: "300", "TORCHELASTIC_RUN_ID": "x"})
    assert (mine.seconds, mine.by_agent) == (300, True)
    if grace.torch_has_shutdown_timeout():
        assert grace.torchrun_timeout(["--nproc-per-node", "2", "--shutdown-timeout", "60", "t.py"], {}) == (
            60, "torchrun --shutdown-timeout")
        assert grace.torchrun_timeout(["--shutdown_timeout=45"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"})[0] == 45
        environ = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}
        assert grace.torchrun_timeout([], environ) == (7, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        assert grace.torchrun_timeout([], {}) == (30, "torchrun's default")
    else:
        assert grace.torchrun_timeout(["--shutdown-timeout", "60"], {})[0] == 30


def test_a_short_grace_warns_with_both_numbers():
    estimate = grace.SaveEstimate(bytes=36_600_000_000, bytes_per_s=1.5e9, source="measured on the save of step 7",
                                  step_s=1.5)
    assert estimate.on_signal_s == pytest.approx(50.3) and estimate.needed_s == 86
    warning = grace.check(estimate, grace.Grace(30, "torchrun's default"))
    assert warning.startswith("warning: a save on a signal may take 50 s (a step of 1.5 s, then up to two saves of "
                              "36.60 GB at 1.5 GB/s, measured on the save of step 7)")
    assert "torchrun SIGKILLs the ranks 30 s after passing a signal on (torchrun's default): give it 86 s" in warning
    assert grace.check(estimate, grace.Grace(86, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")) is None
    assert grace.check(estimate, grace.Grace(30, "cce_parallel.train.torchrun", by_agent=True)) is None
    assert grace.check(estimate, grace.Grace(None, "no launcher agent")) is None


def test_dry_run_prints_the_checkpoint_and_its_save_time(tmp_path):
    """The Gemma 2 2B recipe: 36.60 GB, as its checkpoint measured on an H200 (docs/training.md:
    36.6 GB); at the assumed 1 GB/s, and at the speed the run directory's saves measured."""
    command = [sys.executable, "-m", "cce_parallel.train", "--recipe", "recipes/gemma-2b-owt.yaml", "--dry-run",
               "--world-size", "4", "--set", f"run.out_dir={tmp_path}"]
    done = subprocess.run(command, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300, check=True)
    assert ("checkpoint: 36.60 GB (2 + 12 bytes per parameter: the weights, fp32 main weights and two Adam moments); "
            "a save takes about 37 s at 1 GB/s (assumed: no save of this run measured yet)") in done.stdout
    assert ("then up to 73 s for the save in flight and the save; the launcher's grace should be at least 120 s"
            in done.stdout)

    run_dir = tmp_path / "gemma-2b-owt"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"kind": "checkpoint", "step": 7, "bytes": 36_600_000_000, "total_s": 24.5}) + "\n")
    from cce_parallel.config import load_recipe
    from cce_parallel.train.estimate import dry_run, format_report

    recipe = load_recipe(ROOT / "recipes" / "gemma-2b-owt.yaml", [f"run.out_dir={tmp_path}"])
    report = dry_run(recipe, world_size=4, quiet=True)
    assert "a save takes about 25 s at 1.49 GB/s (measured on the save of step 7)" in format_report(recipe, report)


# -- end to end ------------------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_a_bare_torchrun_whose_grace_is_shorter_than_the_save_warns(tiny_data, tmp_path):
    """A bare torchrun with a 15 s grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and a disk that writes
    0.5 MB/s (a save of the tiny model, 3.4 MB over two ranks, takes about 4 s; on a signal up to
    two of them and a step, with a margin: more than 15 s, where a normal disk's 0.2 s saves need
    less). The first start saves at step 2 and warns once that save has measured the disk; the
    restart (on a normal disk) warns at start-up, before its first step, with both numbers."""
    env = _slow_disk_env(tmp_path, 0.5e6, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="15")
    run_dir = tmp_path / "short-grace"
    overrides = base_overrides(tmp_path, tiny_data, "short-grace") + ["checkpoint.interval=0", "eval.iters=1"]
    first = run_train(overrides + ["train.stop_at=2"], env=env, torchrun=True)
    pattern = (r"warning: a save on a signal may take ([\d.]+) s \(.*measured on the save of step 2\); "
               r"but torchrun SIGKILLs the ranks 15 s after passing a signal on \(TORCH_ELASTIC_SHUTDOWN_TIMEOUT\): "
               r"give it (\d+) s")
    assert re.search(pattern, first.stderr), first.stderr[-3000:]
    assert [r["step"] for r in _records(run_dir, "grace_warning")] == [2]  # after the save of step 2

    normal_disk = _slow_disk_env(tmp_path, None, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="15")
    second = run_train(overrides + ["train.stop_at=3"], env=normal_disk, torchrun=True)
    found = re.search(pattern, second.stderr)
    assert found, second.stderr[-3000:]
    assert int(found[2]) > 15 and float(found[1]) >= 2 * 3  # two saves of about 4 s
    assert [r["step"] for r in _records(run_dir, "grace_warning")] == [2, 2]  # the second at start-up, at step 2
    print(f"grace warning: first start {first.seconds:.1f} s, second {second.seconds:.1f} s")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_save_slower_than_the_grace_publishes_through_the_launch_script(tiny_reference, tiny_data, tmp_path):
    """launch/train.sh cpu:2, started as a user starts it, with torchrun's grace shortened from its
    default 30 s to 1 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1: the 30 s that an 85 s save of an 8B
    model outlasts, made short so that the test need not wait) and a disk that writes 0.5 MB/s (a
    save takes about 3.5 s). SIGTERM to the script's process group once a save has measured the
    disk: the launchers' agent waits as long as the ranks' estimate says, the save is published
    and the command exits 0, more than the grace after the signal. The restart, the same command,
    continues from that checkpoint with the uninterrupted run's losses, bit for bit."""
    from cce_parallel.train.checkpoint import verify
    from cce_parallel.train.metrics import read_metrics

    _, reference, _ = tiny_reference
    venv_bin = str(Path(sys.executable).parent)  # an activated environment: its python first on PATH
    env = _slow_disk_env(tmp_path, 0.5e6, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    env["PATH"] = os.pathsep.join([venv_bin, env["PATH"]])
    run_dir = tmp_path / "slow-save"
    overrides = base_overrides(tmp_path, tiny_data, "slow-save") + ["checkpoint.interval=2", "eval.iters=1"]
    command = ["bash", "launch/train.sh", "cpu:2", "recipes/tiny.yaml", "--set", *overrides]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _records(run_dir, "checkpoint") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler signals a job: the launcher's process group
        signalled = time.monotonic()
        output = proc.communicate(timeout=120)[0]
        after_signal = time.monotonic() - signalled
    finally:
        for pid in reversed([proc.pid, *_descendants(proc.pid)]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-4000:]
    waited = re.search(r"\[cce torchrun\] SIGTERM: giving the workers up to (\d+) s to save and stop .*not 1 s", output)
    assert waited and int(waited[1]) > 1, output[-4000:]
    stopped = re.search(r"\[cce torchrun\] SIGTERM: every rank here \(2\) saved step (\d+) ", output)
    assert stopped, output[-4000:]
    step = int(stopped[1])
    assert after_signal > 2.0, after_signal  # the save outlasted the 1 s grace
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:07d}"
    assert verify(run_dir / "checkpoints" / f"step_{step:07d}")["step"] == step
    assert _records(run_dir, "stop")[-1]["reason"] == "signal"

    normal_disk = _slow_disk_env(tmp_path, None, PATH=env["PATH"])
    restart = subprocess.run(command + [f"train.stop_at={step + 2}"], cwd=ROOT, env=normal_disk, capture_output=True,
                             text=True, timeout=300, check=False)
    assert restart.returncode == 0, restart.stdout[-3000:] + restart.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:07d}'} at step {step}" in restart.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = range(step + 1, step + 3)
    assert [metrics["train"][s]["loss"] for s in steps] == [reference["train"][s]["loss"] for s in steps]  # bitwise
    print(f"slow save: stopped at step {step}, {after_signal:.1f} s after SIGTERM")
