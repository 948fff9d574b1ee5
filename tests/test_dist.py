"""tests/dist.py's run_entry_point, which the end-to-end tests use in place of torchrun on CPU: the
ranks get torchrun's variables and the arguments, their output comes back, and a failed rank
stops the others and fails the launch, as torchrun's agent does."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist import run_entry_point

ROOT = Path(__file__).resolve().parents[1]


def _rank_one_fails():
    """An entry point: every rank says who it is; rank 1 then raises, once all have spoken (each
    marks a file in CCE_TEST_RANKS_DIR); the others wait for a signal."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"rank {rank} of {world} (local {os.environ['LOCAL_RANK']}): {sys.argv[1:]}", flush=True)
    marks = Path(os.environ["CCE_TEST_RANKS_DIR"])
    (marks / str(rank)).touch()
    if rank == 1:
        while len(list(marks.iterdir())) < world:
            time.sleep(0.01)
        raise ValueError("rank 1 fails")
    signal.pause()  # torchrun's SIGTERM ends this: its default action
    return 0


def _sleeps():
    time.sleep(60)


def test_a_failed_rank_stops_the_others_and_fails_the_launch(tmp_path):
    start = time.monotonic()
    done = run_entry_point(["--set", "a=1"], 3, env=dict(os.environ, CCE_TEST_RANKS_DIR=str(tmp_path)), cwd=ROOT,
                           timeout=60, main="tests.test_dist:_rank_one_fails")
    assert time.monotonic() - start < 20  # the others were stopped, not left to the timeout
    assert done.returncode == 1
    for rank in range(3):
        assert f"rank {rank} of 3 (local {rank}): ['--set', 'a=1']" in done.stdout
    assert "ValueError: rank 1 fails" in done.stderr


def test_a_launch_past_its_timeout_is_killed():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_entry_point([], 2, env=dict(os.environ), cwd=ROOT, timeout=2, main="tests.test_dist:_sleeps")
    assert time.monotonic() - start < 20
