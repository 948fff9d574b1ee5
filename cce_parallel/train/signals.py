"""Preemption: a signal (or the end of train.exit_duration) makes the run save at the next step
boundary and exit 0.

On the first of ``checkpoint.signals`` (default SIGTERM and SIGUSR1: what SLURM sends before a
time limit or a preemption, and what torchrun forwards to its workers) each rank notes it. After
every step the ranks take the maximum of their notes (one all-reduce of two numbers), so they all
stop after the same step even when the signal reached them at different times. The trainer then
saves, waits for the checkpoint, and exits 0; a restart resumes from it. (torchrun's own agent then
exits 1 all the same; the job's launcher, cce_parallel.train.torchrun, exits 0: see torchrun.py.)

A second signal exits at once (exit status 128 + its number), and so does the deadline
``checkpoint.signal_deadline_s`` after the first, from a timer thread: a rank stuck in a collective
never reaches the next step boundary. Signals within ``SAME_SIGNAL_S`` of the first count as that
one: torchrun forwards to its workers a signal that SLURM also sent to them directly.

The same all-reduce carries each rank's verdict on ``train.exit_duration`` (the trainer's: would
another step and its save end after it?), so that the ranks also stop together for that.
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

SAME_SIGNAL_S = 2.0


class StopOnSignal:
    """Installs the handlers (main thread only); ``agreed()`` is the collective check."""

    def __init__(self, names: list[str], deadline_s: float | None, device: str):
        self.deadline_s, self.device = deadline_s, device
        self.first: tuple[int, float] | None = None
        self._timer: threading.Timer | None = None
        self._previous = {}
        for name in names:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, _frame):
        now = time.monotonic()
        if self.first is None:
            self.first = (number, now)
            _say(f"received {signal.Signals(number).name}: saving after this step, then exiting "
                 "(a second signal exits at once)")
            if self.deadline_s:
                self._timer = threading.Timer(self.deadline_s, self._exit, args=(number, "the deadline passed"))
                self._timer.daemon = True
                self._timer.start()
        elif now - self.first[1] > SAME_SIGNAL_S:
            self._exit(number, f"a second signal ({signal.Signals(number).name})")

    @staticmethod
    def _exit(number: int, why: str):
        _say(f"{why}: exiting at once, without a checkpoint")
        os._exit(128 + number)

    def agreed(self, time_up: bool = False) -> str | None:
        """Collective (every rank calls it after each step): ``"signal"`` when any rank has received
        a signal, else ``"exit_duration"`` when time_up on any rank, else None. One all-reduce."""
        flags = torch.tensor([0.0 if self.first is None else 1.0, 1.0 if time_up else 0.0],
                             device=torch.cuda.current_device() if self.device == "cuda" else "cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, out_of_time = flags.tolist()
        return "signal" if signalled else "exit_duration" if out_of_time else None

    def restore(self):
        """The handlers from before, and no deadline (the run has saved, or stops otherwise)."""
        if self._timer is not None:
            self._timer.cancel()
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _say(line: str):
    """One line to stderr without Python's buffered stream: a handler that printed while the
    interrupted code was printing would raise (buffered streams are not reentrant)."""
    os.write(sys.stderr.fileno(), (line + "\n").encode())
