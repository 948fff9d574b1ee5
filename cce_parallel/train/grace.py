"""How long a save on a signal takes, and how long the launcher lets it run.

After passing a signal on to its workers, torchrun's agent waits its shutdown timeout (the
"grace"), then SIGKILLs them: a save on a signal must be published within it. torchrun reads it
from ``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (default 30 s) where it has that
option (torch 2.13 does); torch 2.11's keeps 30 s.

The save's time is estimated from its bytes and a write speed:
- bytes: the resumed checkpoint's (its meta.json lists them), else the parameters each stored
  once (tensor-parallel shards summed, data-parallel copies once) times the bytes each takes in a
  checkpoint (``checkpoint_bytes``);
- speed: bytes over total seconds of the newest save recorded in the run directory's
  metrics.jsonl (from the save's start to its publication, over all ranks), else an assumed
  ``ASSUMED_BYTES_PER_S``.

On a signal the job finishes its step, waits for a background save still in flight, then saves:
up to a step and two saves (``SaveEstimate.on_signal_s``). The grace it needs is that times
``MARGIN`` plus ``SLACK_S`` (for teardown and a disk slower than measured): ``needed_s``.

``python -m cce_parallel.train.torchrun`` (the launch scripts' and the plain start's agent) gives
its workers that much: the workers write their estimate into the agent's directory
(``report_to_agent``), the agent reads it when a signal comes. Under a bare torchrun the job
compares the grace with the need at start-up and after each save, and warns (``check``).
Each rank that stopped cleanly on a signal leaves a marker there too (``mark_stopped``): the
agent then exits 0 instead of torchrun's 1 (see torchrun.py).

No torch at import: the agent imports this module before torch's launcher.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

# The first estimate of the write speed of a whole checkpoint (all ranks together), before a save
# of this run has measured it. 1 GB/s is below what 4 H200 (1.5 GB/s) and 4 H100 wrote for the
# Gemma 2 2B recipe's 36.6 GB (docs/training.md): a conservative guess for a node's local disks.
ASSUMED_BYTES_PER_S = 1e9
MARGIN = 1.5
SLACK_S = 10.0
TORCHRUN_DEFAULT_GRACE_S = 30

# Set by cce_parallel.train.torchrun in its workers' environment.
AGENT_DIR_ENV = "CCE_AGENT_DIR"  # a directory the agent shares with its workers
AGENT_GRACE_ENV = "CCE_AGENT_GRACE_S"  # its shutdown timeout (on a signal it waits longer where the save needs it)
ESTIMATE_FILE = "save_estimate.json"


def checkpoint_bytes(params_stored: int, width: int, fsdp: str = "none") -> int:
    """Bytes of a checkpoint of params_stored parameters: the weights in the model's dtype (width
    bytes; none under Megatron-FSDP, which rebuilds them from the main weights), the optimizer's
    fp32 main weights (fp32 runs: its copy of the parameters) and two fp32 Adam moments. The RNG
    states and JSON files are small beside them; DCP's per-tensor framing is not counted."""
    return params_stored * ((0 if fsdp == "megatron" else width) + 12)


@dataclass
class SaveEstimate:
    """A save's bytes and write speed, and what follows for a stop on a signal."""

    bytes: int
    bytes_per_s: float
    source: str  # where the speed comes from, for the log
    step_s: float = 0.0  # a training step, if measured
    asynchronous: bool = True  # a background save may be in flight when the signal comes

    @property
    def save_s(self) -> float:
        return self.bytes / self.bytes_per_s

    @property
    def on_signal_s(self) -> float:
        """A step, the background save in flight (asynchronous saves), and the save."""
        return self.step_s + self.save_s * (2 if self.asynchronous else 1)

    @property
    def needed_s(self) -> int:
        return math.ceil(MARGIN * self.on_signal_s + SLACK_S)

    def describe(self) -> str:
        step = f"a step of {format_seconds(self.step_s)}, then " if self.step_s else ""
        saves = "up to two saves" if self.asynchronous else "a save"
        return (f"a save on a signal may take {format_seconds(self.on_signal_s)} ({step}{saves} of "
                f"{format_bytes(self.bytes)} at {self.bytes_per_s / 1e9:.3g} GB/s, {self.source})")

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "bytes_per_s": self.bytes_per_s, "source": self.source, "step_s": self.step_s,
                "asynchronous": self.asynchronous, "on_signal_s": self.on_signal_s, "needed_s": self.needed_s}


def format_seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 1 else f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def format_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def measured(run_dir: Path) -> dict | None:
    """From the newest records of metrics.jsonl (or, before a fresh start moved it, .prev):
    {"bytes_per_s", "bytes", "step" (of that save), "step_s" (the newest step's time)}, or None
    when no save has been recorded."""
    found = None
    step_s = None
    for name in ("metrics.jsonl.prev", "metrics.jsonl"):
        try:
            lines = (Path(run_dir) / name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written
                continue
            if record.get("kind") == "checkpoint" and record.get("bytes") and record.get("total_s"):
                found = {"bytes_per_s": record["bytes"] / record["total_s"], "bytes": record["bytes"],
                         "step": record.get("step")}
            elif record.get("kind") == "train" and record.get("step_time"):
                step_s = record["step_time"]
    if found is None:
        return None
    return dict(found, step_s=step_s)


def estimate(save_bytes: int, *, run_dir: Path | None, asynchronous: bool, step_s: float | None = None) -> SaveEstimate:
    """The estimate for a checkpoint of save_bytes, with the speed measured in run_dir if any."""
    history = measured(run_dir) if run_dir is not None else None
    if history:
        rate = history["bytes_per_s"]
        source = f"measured on the save of step {history['step']}"
        step_s = step_s if step_s is not None else history.get("step_s")
    else:
        rate, source = ASSUMED_BYTES_PER_S, "assumed: no save of this run measured yet"
    return SaveEstimate(bytes=int(save_bytes), bytes_per_s=rate, source=source, step_s=step_s or 0.0,
                        asynchronous=asynchronous)


# -- the grace the launcher gives -----------------------------------------------------------------

@dataclass(frozen=True)
class Grace:
    """The seconds between the launcher passing a signal on and its SIGKILL. seconds None: no
    launcher agent (a single process, or srun starting each rank); by_agent: our agent, which
    waits as long as the save needs (configured: its shutdown timeout otherwise)."""

    seconds: float | None
    source: str
    by_agent: bool = False


def torch_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun has --shutdown-timeout (and reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def _flag_value(argv: list[str]) -> str | None:
    """--shutdown-timeout's value in a torchrun command line, if given."""
    for i, arg in enumerate(argv):
        for flag in ("--shutdown-timeout", "--shutdown_timeout"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def torchrun_timeout(argv: list[str], environ) -> tuple[float, str]:
    """(seconds, where from) of torchrun's shutdown timeout for its command line argv."""
    if not torch_has_shutdown_timeout():
        return TORCHRUN_DEFAULT_GRACE_S, "this torch's torchrun has no --shutdown-timeout: always 30 s"
    value = _flag_value(argv)
    if value is not None:
        return float(value), "torchrun --shutdown-timeout"
    if environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        return float(environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    return TORCHRUN_DEFAULT_GRACE_S, "torchrun's default"


def launcher_grace(environ=None) -> Grace:
    """The grace of this worker's launcher: our agent's (it says so in the environment), a bare
    torchrun's (its command line is the parent process's), or none."""
    environ = os.environ if environ is None else environ
    if environ.get(AGENT_GRACE_ENV):
        return Grace(float(environ[AGENT_GRACE_ENV]), "cce_parallel.train.torchrun", by_agent=True)
    if "TORCHELASTIC_RUN_ID" not in environ:
        return Grace(None, "no launcher agent")
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    seconds, source = torchrun_timeout(argv, environ)
    return Grace(seconds, source)


def check(estimate: SaveEstimate, grace: Grace) -> str | None:
    """A warning line where the grace is shorter than the save on a signal needs, else None."""
    if grace.seconds is None or grace.by_agent or grace.seconds >= estimate.needed_s:
        return None
    need = estimate.needed_s
    if torch_has_shutdown_timeout():
        fix = f"torchrun --shutdown-timeout {need} (or export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={need})"
    else:
        fix = "nothing on this torchrun's command line sets it"
    return (f"warning: {estimate.describe()}; but torchrun SIGKILLs the ranks {grace.seconds:.0f} s after passing a "
            f"signal on ({grace.source}): give it {need} s. Start with launch/train.sh, launch/multinode.sh, "
            f"launch/slurm.sbatch or python -m cce_parallel.train (their agent waits as long as the save needs), "
            f"or {fix}")


# -- what the workers tell the agent ---------------------------------------------------------------

def _agent_dir(environ) -> Path | None:
    value = environ.get(AGENT_DIR_ENV)
    return Path(value) if value else None


def report_to_agent(estimate: SaveEstimate, environ=None):
    """The node's first rank writes the estimate where its agent reads it on a signal."""
    environ = os.environ if environ is None else environ
    directory = _agent_dir(environ)
    if directory is None or environ.get("LOCAL_RANK", "0") != "0":
        return
    tmp = directory / f".{ESTIMATE_FILE}.tmp"
    tmp.write_text(json.dumps(estimate.to_json()))
    os.replace(tmp, directory / ESTIMATE_FILE)


def agent_estimate(directory: Path) -> dict | None:
    try:
        return json.loads((directory / ESTIMATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def mark_stopped(step: int, path: str | None, reason: str, environ=None):
    """This rank's training ended cleanly at step (reason: "signal", "exit_duration", "stop_at" or
    "done"), its newest checkpoint (path) published, and it has torn down: the marker its agent
    counts after a signal."""
    environ = os.environ if environ is None else environ
    directory = _agent_dir(environ)
    if directory is None:
        return
    rank = environ.get("RANK", "0")
    record = {"rank": int(rank), "local_rank": int(environ.get("LOCAL_RANK", "0")),
              "local_world_size": int(environ.get("LOCAL_WORLD_SIZE", "1")), "step": step, "path": path,
              "reason": reason}
    tmp = directory / f".stopped.rank{rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / f"stopped.rank{rank}.json")


def stopped_markers(directory: Path) -> list[dict]:
    markers = []
    for path in sorted(directory.glob("stopped.rank*.json")):
        try:
            markers.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return markers
