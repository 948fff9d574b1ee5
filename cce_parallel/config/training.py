"""The recipe's sections of how the run goes: ``run`` (name, directory, seed, device), ``train``
(batch sizes, steps, precision), ``optim``, ``data``, ``eval``, ``checkpoint`` and ``logging``.
Each section checks its own fields in ``__post_init__``; the checks across sections are
``Recipe``'s (schema.py). No torch and no kernels.
"""

import signal
from dataclasses import dataclass, field
from typing import Literal

from cce_parallel.config.section import Section


@dataclass
class RunConfig(Section):
    """Where the run lives and what it runs on."""

    SECTION = "run"

    name: str = "tiny"
    """The run's name: its directory is ``out_dir/name`` and its wandb run name."""
    out_dir: str = "runs"
    """Parent directory of run directories (resolved recipe, metrics.jsonl, checkpoints, wandb)."""
    seed: int = 1234
    """Seed of the model initialization and of every random stream (per rank as Megatron derives them)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """``auto``: CUDA when available (NCCL), else CPU (gloo, Triton kernels under the interpreter)."""
    dist_timeout_minutes: float = 30.0
    """Timeout of collectives; rank 0 prepares the dataset while the others wait in one."""

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name in (".", ".."):
            self._fail("name", "must be a non-empty directory name without '/'")
        if not self.out_dir:
            self._fail("out_dir", "must be a non-empty path")
        if self.seed < 0:
            self._fail("seed", "must be >= 0")
        self._positive("dist_timeout_minutes")


@dataclass
class TrainConfig(Section):
    """Batch sizes, length of the run, precision."""

    SECTION = "train"

    steps: int = 50
    """Optimizer steps of the whole run (the learning-rate schedule spans them unless
    optim.decay_steps is set)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on each data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks
    = micro_batch_size · grad_accumulation · data-parallel size."""
    grad_accumulation: int | None = None
    """Micro-batches per step on each rank; None: derived from the batch sizes."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Parameter/compute dtype: ``auto`` is bf16 on CUDA (fp32 main weights, gradients reduced in
    fp32) and fp32 on CPU (the Triton interpreter has no bf16)."""
    stop_at: int | None = None
    """Stop after this step (saving a checkpoint) without changing the schedule, like Megatron-LM's
    --exit-interval; a later start resumes. None: run all steps."""
    exit_duration: float | None = None
    """Wall-clock budget of this start, in minutes (as Megatron-LM's --exit-duration-in-mins),
    counted from the process's start: the run stops with a checkpoint after the last step that
    leaves time for another step and a save (the save's estimate: docs/training.md) within it, and
    exits 0, so that a job ends on its own before its allocation does; a later start resumes (and
    gets the budget afresh). Leave a minute or two of the allocation beyond it for start-up and
    teardown. None: no budget."""
    deterministic: bool = False
    """Bitwise reproducible GPU runs (same recipe, seed and layout; a resumed run equals one that
    never stopped): deterministic torch kernels (embedding and attention backward included),
    megatron-core's deterministic_mode, a fixed NCCL algorithm (NCCL_ALGO=Ring unless set) and
    CUBLAS_WORKSPACE_CONFIG. Costs some throughput (see docs). CPU runs are deterministic anyway."""

    def __post_init__(self):
        self._positive("steps", "micro_batch_size", "global_batch_size")
        self._positive("grad_accumulation", "stop_at", "exit_duration", allow_none=True)
        if self.global_batch_size % self.micro_batch_size:
            self._fail("global_batch_size", f"must be a multiple of train.micro_batch_size={self.micro_batch_size}")


@dataclass
class OptimConfig(Section):
    """AdamW with linear warmup and a decay to min_lr, gradient clipping."""

    SECTION = "optim"

    lr: float = 1e-2
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 1e-3
    """Learning rate at the end of the decay."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from lr to min_lr after the warmup."""
    warmup_steps: int = 4
    """Linear warmup from 0 to lr."""
    decay_steps: int | None = None
    """Steps of warmup + decay (Megatron-LM's --lr-decay-iters); past them the rate stays at
    min_lr. None: train.steps. Set it to the old train.steps to extend a finished run without
    starting its decay over (docs/training.md, "Extending a run")."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not on biases and norm weights, as Megatron does)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0: no clipping."""
    fused: bool = True
    """On CUDA without apex, switch torch's AdamW to its fused kernel (apex FusedAdam is used where
    installed). CPU runs use the plain AdamW."""

    def __post_init__(self):
        self._positive("lr", "eps")
        self._positive("decay_steps", allow_none=True)
        self._non_negative("min_lr", "warmup_steps", "weight_decay", "clip_grad")
        if self.min_lr > self.lr:
            self._fail("min_lr", f"must be <= optim.lr={self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                self._fail(name, "must be in [0, 1)")
        if self.decay_steps is not None and self.warmup_steps >= self.decay_steps:
            self._fail("warmup_steps", f"must be < optim.decay_steps={self.decay_steps}")


@dataclass
class DataConfig(Section):
    """The text and tokenizer (cce_parallel.data.prepare_dataset), prepared once into ``dir``."""

    SECTION = "data"

    source: str = "stdlib"
    """``stdlib`` (offline: docstrings of the Python standard library), ``openwebtext``,
    ``hf:<dataset>[:<config>]``, or a local directory/file of .txt, .jsonl, .parquet, .xz."""
    tokenizer: str = "bpe"
    """``bpe`` (a byte-level BPE trained on the source, data.vocab_size tokens), ``hf:<name>``
    (e.g. hf:gpt2) or ``tiktoken:<encoding>``."""
    vocab_size: int = 1024
    """Vocabulary of the trained BPE (only with tokenizer: bpe)."""
    dir: str | None = None
    """Where the prepared dataset lives; None: ``data/<source>-<tokenizer>[-<vocab_size>]``.
    Rank 0 prepares it when missing (idempotent)."""
    valid_fraction: float = 0.01
    """Share of the documents held out for validation."""
    max_documents: int | None = None
    """Use only the first N documents of the source."""
    seed: int = 1234
    """Seed of the train/validation split, the BPE training and the sample shuffling."""

    def __post_init__(self):
        if not self.source:
            self._fail("source", "must be non-empty")
        if self.tokenizer != "bpe" and not self.tokenizer.startswith(("hf:", "tiktoken:")):
            self._fail("tokenizer", "must be 'bpe', 'hf:<name or path>' or 'tiktoken:<encoding>'")
        if self.vocab_size < 258:
            self._fail("vocab_size", "must be >= 258 (a byte-level BPE needs 256 bytes + specials)")
        if not 0.0 < self.valid_fraction < 1.0:
            self._fail("valid_fraction", "must be in (0, 1)")
        if self.max_documents is not None and self.max_documents < 2:
            self._fail("max_documents", "must be >= 2, or null")
        if self.seed < 0:
            self._fail("seed", "must be >= 0")

    def resolved_dir(self) -> str:
        if self.dir:
            return self.dir
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{self.source}-{self.tokenizer}")
        return f"data/{name}-{self.vocab_size}" if self.tokenizer == "bpe" else f"data/{name}"


@dataclass
class EvalConfig(Section):
    """Validation loss and perplexity on the held-out split."""

    SECTION = "eval"

    interval: int = 20
    """Evaluate every this many steps (and always at the end); 0: only at the end."""
    iters: int = 4
    """Batches of train.global_batch_size per evaluation (the same batches every time)."""

    def __post_init__(self):
        self._non_negative("interval")
        self._positive("iters")


@dataclass
class CheckpointConfig(Section):
    """Checkpoints: model, optimizer, scheduler, data position and RNG states, written atomically."""

    SECTION = "checkpoint"

    interval: int = 10
    """Save every this many steps (and at the end); 0: only at the end."""
    at_end: bool = True
    """Save at the last step. false: not there (nor anywhere with interval 0), for a run whose
    state nobody needs, such as a benchmark's (a Gemma 2 2B checkpoint takes 20-30 s to write on
    4x H100); a stop at train.stop_at or on a signal still saves."""
    dir: str | None = None
    """Checkpoint directory; None: ``<run dir>/checkpoints``."""
    keep: int = 2
    """Keep the newest N checkpoints; 0: keep all."""
    resume: str = "auto"
    """``auto``: continue from the newest checkpoint in dir when there is one; ``never``: start
    fresh (refusing a dir that holds checkpoints); or the path of one checkpoint to start from."""
    asynchronous: bool = True
    """Write checkpoints in the background: training waits only while the state is copied to host
    memory; the write, the checksums and the rename into place follow in a thread. The next save,
    the end of the run or a signal waits for the one before. false: training waits for the write."""
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make the run finish its step, save, and exit 0 (a restart resumes); a second
    one exits at once. SIGUSR1 is what launch/slurm.sbatch asks SLURM to send before the time
    limit. [] leaves every signal's default action (SIGTERM kills the run)."""
    signal_deadline_s: float | None = None
    """After the first signal, exit at once (without a checkpoint) if the run has not finished
    its save and exited within this many seconds; None: no deadline."""
    lean: bool = False
    """Make every save lean, as the save on a signal (or at train.exit_duration) always is: leave
    out the model's weights where the optimizer state holds a main weight for every one of them
    (bf16 runs: megatron's fp32 copies, some 14 % of the bytes; fp32 runs on CPU: the parameters
    themselves, which the optimizer's entries already hold, 25 %). Resuming and the export read
    the main weights then. With the distributed optimizer (shards of the main weights only) every
    save keeps the weights; under Megatron-FSDP none ever does."""

    def __post_init__(self):
        self._non_negative("interval", "keep")
        self._positive("signal_deadline_s", allow_none=True)
        if not self.resume:
            self._fail("resume", "must be 'auto', 'never' or a checkpoint path")
        known = {s.name for s in signal.Signals} - {"SIGKILL", "SIGSTOP"}
        for name in self.signals:
            if name not in known:
                self._fail("signals", f"{name!r} is not a signal that can be caught; e.g. SIGTERM, SIGUSR1")
        if len(set(self.signals)) != len(self.signals):
            self._fail("signals", "lists a signal twice")


@dataclass
class LoggingConfig(Section):
    """Console, metrics.jsonl (always, in the run directory) and wandb."""

    SECTION = "logging"

    interval: int = 5
    """Print a progress line (step, loss, lr, tokens/s, MFU, peak memory) every this many steps."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; the environment variable WANDB_MODE, when set, wins."""
    wandb_project: str = "cce_parallel"
    """wandb project."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for the MFU; None: looked up from the GPU name (bf16 dense:
    H100/H200 989, A100 312); no MFU on CPU unless given."""

    def __post_init__(self):
        self._positive("interval")
        self._positive("peak_tflops", allow_none=True)
        if not self.wandb_project:
            self._fail("wandb_project", "must be non-empty")
