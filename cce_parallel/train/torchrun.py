"""torchrun for the train job: the same agent and arguments, with an exit status a scheduler can read
and a grace that fits the save.

    python -m cce_parallel.train.torchrun --nproc-per-node 8 -m cce_parallel.train --recipe R.yaml

The launch scripts and the plain start (``python -m cce_parallel.train``, ``cce-train``) run the
ranks through it. It runs torch's own torchrun (``torch.distributed.run.main``) in this process,
so a signal to this pid or its process group reaches torchrun's agent as before. It differs in
three ways:

- **Exit status.** Having passed a signal on to its workers, torchrun raises its SignalException
  and exits 1 (a crash's status) whatever the workers did. Here, when every rank of this node
  stopped cleanly on that signal after its checkpoint was published (each leaves a marker in a
  directory this agent shares with them, grace.mark_stopped), it exits 0 (``EXIT_STOPPED``);
  otherwise 128 + the signal's number, as a shell reports a process killed by it. A failure of a
  rank stays torchrun's 1, a finished run 0.
- **Grace.** On a signal, torchrun SIGKILLs its workers after its shutdown timeout. Here it waits
  at least as long as the workers' estimate of their save (grace.py: they write it into the shared
  directory at start-up and after each save), and says so when that is longer. This holds on a
  torch whose torchrun has no --shutdown-timeout, too (it waits 30 s there).
- **Defaults.** SIGUSR1 is among the signals passed on (launch/slurm.sbatch's warning before the
  time limit), and the shutdown timeout is 300 s, unless set (``PET_SIGNALS_TO_HANDLE``,
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``: launch/env.sh sets the same).

The grace and the exit status rest on two names inside torch's elastic launcher,
``_terminate_process_handler`` and ``PContext.close(death_sig, timeout)`` (tested on torch 2.13);
where they are missing or changed it says so and runs as plain torchrun.
"""

import contextlib
import inspect
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from cce_parallel.train import grace
from cce_parallel.train.signals import SAME_SIGNAL_S

EXIT_STOPPED = 0  # every rank saved on a signal and stopped: resume by starting again


def signal_defaults(environ=None):
    """torchrun forwards the signals it handles to its workers and SIGKILLs them after a timeout.
    Add SIGUSR1 (unhandled, it would kill torchrun and so its workers) and give a save 300 s
    instead of 30 (launch/env.sh does the same)."""
    environ = os.environ if environ is None else environ
    # torchrun reads its --signals-to-handle from PET_SIGNALS_TO_HANDLE (and overwrites
    # TORCHELASTIC_SIGNALS_TO_HANDLE with it).
    environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")


def _say(line: str):
    print(f"[cce torchrun] {line}", file=sys.stderr, flush=True)


class _Agent:
    """What this process adds to torchrun's agent: the signal it got, and the grace on it."""

    def __init__(self, directory: Path, configured: float):
        self.directory, self.configured = directory, configured
        self.signal: int | None = None
        self.first = 0.0

    def install(self) -> bool:
        from torch.distributed.elastic.multiprocessing import api

        handler = getattr(api, "_terminate_process_handler", None)
        close = getattr(api.PContext, "close", None)
        if handler is None or close is None or "timeout" not in inspect.signature(close).parameters:
            _say("this torch's elastic launcher has changed: running as plain torchrun (exit 1 after a signal, "
                 "its own grace)")
            return False

        def on_signal(signum, frame):  # installed by torchrun's PContext.start: looked up then
            now = time.monotonic()
            if self.signal is None:
                self.signal, self.first = signum, now
            elif now - self.first <= SAME_SIGNAL_S:
                return  # the same signal, sent twice (SLURM to this task, and srun passing it on)
            handler(signum, frame)  # raises SignalException; a later one cuts the grace short

        def close_with_grace(context, death_sig=None, timeout=30):
            if self.signal is not None:
                timeout = max(timeout, self._needed(timeout))
            return close(context, death_sig, timeout)

        api._terminate_process_handler = on_signal
        api.PContext.close = close_with_grace
        return True

    def _needed(self, timeout: float) -> float:
        """The workers' estimate of the grace their save needs (announced when longer than timeout)."""
        estimate = grace.agent_estimate(self.directory)
        if not estimate:
            return timeout
        needed = float(estimate["needed_s"])
        if needed > timeout:
            _say(f"{signal.Signals(self.signal).name}: giving the workers up to {needed:.0f} s to save and stop "
                 f"(the save's estimate: {estimate['on_signal_s']:.1f} s, with a margin), not {timeout:.0f} s")
        return needed

    def outcome(self, signum: int) -> int:
        """The exit status after torchrun stopped on signal signum."""
        name = signal.Signals(signum).name
        markers = grace.stopped_markers(self.directory)
        expected = markers[0]["local_world_size"] if markers else None
        if markers and len(markers) == expected:
            steps = sorted({m["step"] for m in markers})
            path = markers[0]["path"]
            saved = f"saved step {steps[-1]} ({path})" if path else f"ended at step {steps[-1]}"
            _say(f"{name}: every rank here ({expected}) {saved} and stopped; exit {EXIT_STOPPED} "
                 "(start again to resume)")
            return EXIT_STOPPED
        got = f"{len(markers)} of {expected}" if markers else "none of the"
        _say(f"{name}: {got} ranks here stopped after a published checkpoint; exit {128 + signum}")
        return 128 + signum


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal_defaults()
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing import SignalException

    configured, _source = grace.torchrun_timeout(argv, os.environ)
    directory = Path(tempfile.mkdtemp(prefix="cce-agent-"))
    agent = _Agent(directory, configured)
    if agent.install():  # the workers inherit these
        os.environ[grace.AGENT_DIR_ENV] = str(directory)
        os.environ[grace.AGENT_GRACE_ENV] = f"{configured:g}"
    try:
        run.main(argv)
    except SignalException as err:
        if agent.signal is None:
            raise
        return agent.outcome(int(err.sigval))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
