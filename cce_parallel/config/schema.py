"""The recipe schema: one dataclass per YAML section, every field documented and checked.

The defaults are the ``tiny`` recipe (``recipes/tiny.yaml`` spells them out): a 2-layer GPT on
the offline stdlib text with a 1,024-token BPE, tensor parallel over 2 ranks, trained in about a
minute on a 2-core CPU. A recipe file holds what differs from these defaults.

Checks happen in three places, each naming the key it rejects:
- the loader (loader.py): unknown keys and wrong types;
- ``__post_init__`` of each section: a field's own range, and the sizes within a section;
- ``Recipe.__post_init__``: sizes across sections (heads % tp, batch sizes, ...), and
  ``Recipe.check_world(world_size, device)``: what needs the launch (tp·pp·dp = world size,
  CUDA-only features on CPU).

This module imports no torch and no kernels: a recipe validates anywhere.
"""

import dataclasses
import math
import signal
from dataclasses import dataclass, field
from typing import Literal

# The loss impls of cce_parallel.IMPLS (tests/config checks the two lists agree), plus megatron-core's
# own output layer for comparison, followed by its unfused loss (vocab_parallel_cross_entropy) or
# its fused one (cross_entropy_loss_fusion).
CCE_IMPLS = ("cce", "cce_kahan", "cce_kahan_full_c", "cce_kahan_full_e", "exact", "torch")
MEGATRON_IMPLS = ("megatron", "megatron_fused")
LOSS_IMPLS = CCE_IMPLS + MEGATRON_IMPLS


# The parts of a dense transformer layer that megatron-core's selective recomputation can rerun
# (its other recompute_modules are for MoE and MLA layers, which the train job does not build).
# Its "mlp" is refused: in the train job on an H100 (megatron-core 0.19.2) the checkpointed MLP's
# backward nested without bound (249 levels) until the GPU ran out of memory, with either loss and
# with or without dropout, on a 4-layer model; on CPU it computes the same gradients.
RECOMPUTE_MODULES = ("core_attn", "layernorm")


class RecipeError(ValueError):
    """A recipe is invalid; the message starts with the offending key (``section.field``)."""


class Section:
    """Base of the section dataclasses: ``SECTION`` is the YAML key, ``_fail`` names the field."""

    SECTION = ""

    def _fail(self, name: str, message: str):
        raise RecipeError(f"{self.SECTION}.{name}: {message} (got {getattr(self, name)!r})")

    def _positive(self, *names: str, allow_none: bool = False):
        for name in names:
            value = getattr(self, name)
            if value is None and allow_none:
                continue
            if value is None or value <= 0:
                self._fail(name, "must be > 0")

    def _non_negative(self, *names: str):
        for name in names:
            if getattr(self, name) < 0:
                self._fail(name, "must be >= 0")


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
class ModelConfig(Section):
    """The GPT: megatron-core GPTModel sizes and variants."""

    SECTION = "model"

    num_layers: int = 2
    """Transformer layers (split evenly over pipeline stages)."""
    hidden_size: int = 64
    """Model width h."""
    num_attention_heads: int = 4
    """Query heads; a multiple of parallel.tensor."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (1: multi-query); None: as many as query heads."""
    kv_channels: int | None = None
    """Head dimension; None: hidden_size / num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP width (of each branch with a gated activation); None: 4 · hidden_size."""
    seq_length: int = 64
    """Tokens per sample (the dataset packs documents into samples of this length)."""
    max_position_embeddings: int | None = None
    """Size of the learned position table; None: seq_length. Unused with rope."""
    vocab_size: int | None = None
    """Vocabulary rows of the model before padding; None: the tokenizer's vocabulary. Must be at
    least the tokenizer's (a larger one, e.g. GPT-2's 50,257 over a smaller BPE, gives the loss
    layer that size; the unused rows only ever see negative gradients)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times parallel.tensor (Megatron-LM's padding)."""
    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute positions (GPT-2) or rotary embeddings (Llama, Gemma)."""
    rotary_base: int = 10000
    """Rotary base period (Llama 3: 500,000). Only with rope."""
    rope_scaling_factor: float | None = None
    """Llama 3.1/3.2's rotary frequency scaling with this factor (megatron-core's: low/high frequency
    factors 1 and 4 over an original context of 8,192; Llama 3.2: 32); None: none. Only with rope."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Layer norm flavour."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the norms."""
    activation: Literal["gelu", "swiglu", "geglu"] = "gelu"
    """MLP activation: gelu (GPT-2), swiglu (Llama), geglu with tanh-approximate GeLU (Gemma)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (GPT-2: yes; Llama, Gemma: no)."""
    scale_embeddings: bool = False
    """Multiply the embedding layer's output by sqrt(hidden_size), rounded to the compute dtype, as
    Gemma does (with learned positions, their sum; the output layer, tied or not, is not scaled)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output layer (classifier) weights."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    recompute_granularity: Literal["selective", "full"] | None = None
    """Activation recomputation (megatron-core's): None keeps every activation for the backward;
    ``full`` keeps only the input of recomputed layers and reruns them in the backward (see
    recompute_method, recompute_num_layers); ``selective`` reruns only recompute_modules."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With full recomputation (required there): ``uniform`` checkpoints every layer of each pipeline
    stage in chunks of recompute_num_layers layers; ``block`` recomputes the first
    recompute_num_layers layers of each stage and keeps the activations of the others."""
    recompute_num_layers: int | None = None
    """With full recomputation (required there): layers per chunk (uniform) or recomputed layers
    per pipeline stage (block); at most the layers of a stage."""
    recompute_modules: str = "core_attn"
    """With selective recomputation: comma-separated parts of each layer to rerun in the backward,
    of ``core_attn`` (the attention softmax·V; with flash-style SDPA or TE attention it frees little,
    as no s² scores are kept) and ``layernorm`` (the two norms' outputs; needs
    model.attention=te: megatron-core checkpoints the norms through Transformer Engine)."""
    attention: Literal["auto", "te", "sdpa"] = "auto"
    """Layer spec: ``te`` Transformer Engine layers, ``sdpa`` megatron-core's local layers with core
    attention on torch's scaled_dot_product_attention (CPU and GPUs), ``auto``: te when Transformer
    Engine is installed and the run is on CUDA, else sdpa. The Gemma 2 options below need sdpa
    (auto picks it for them)."""
    attention_softcap: float | None = None
    """Gemma 2's attention-logit soft-capping softcap · tanh(score / softcap) on every layer (Gemma 2:
    50.0), by flex_attention on CUDA; None: off. No attention dropout with it."""
    sliding_window: int | None = None
    """Gemma 2's sliding-window attention on every other layer (the 1st, 3rd, ...): a query sees the
    sliding_window most recent positions, itself included (Gemma 2: 4096); None: all layers global."""
    post_norms: bool = False
    """Gemma 2's sandwich norms: a norm on the attention output and on the MLP output, before each
    residual add (as well as the pre-norms)."""
    init_from: str | None = None
    """``hf:<dir>``: start from the weights of a local transformers model directory (config.json +
    safetensors, as save_pretrained writes it) of the same architecture and sizes (checked; GPT-2,
    Llama or Gemma 2, see cce_parallel.hf); each rank reads only its own shards. Ignored when the run
    resumes from a checkpoint. None: random initialization."""
    zero_centered_norm: bool = False
    """Norm weights w applied as (1 + w) and initialized to 0, as Gemma stores them (megatron-core's
    layernorm_zero_centered_gamma); the norms compute in fp32."""

    def __post_init__(self):
        self._positive("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                       "make_vocab_size_divisible_by", "rotary_base", "layernorm_epsilon", "init_method_std")
        self._positive("num_query_groups", "kv_channels", "ffn_hidden_size", "max_position_embeddings",
                       "vocab_size", allow_none=True)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            self._fail("num_attention_heads", f"must divide hidden_size={self.hidden_size} (or set model.kv_channels)")
        self._positive("rope_scaling_factor", allow_none=True)
        if self.rope_scaling_factor is not None and self.position_embedding != "rope":
            self._fail("rope_scaling_factor", "needs position_embedding=rope")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            self._fail("num_query_groups", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            self._fail("max_position_embeddings", f"must be >= seq_length={self.seq_length}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                self._fail(name, "must be in [0, 1)")
        self._positive("attention_softcap", "sliding_window", allow_none=True)
        if self.init_from is not None and (not self.init_from.startswith("hf:") or len(self.init_from) < 4):
            self._fail("init_from", "must be hf:<transformers model directory>, or null")
        for name in self.gemma2_options:
            if self.attention == "te":
                self._fail("attention", f"te cannot express model.{name} (Transformer Engine layers); use sdpa or auto")
            if name in ("attention_softcap", "sliding_window") and self.attention_dropout > 0:
                self._fail("attention_dropout", f"must be 0 with model.{name} (flex_attention has no dropout)")
        self._check_recompute()

    def _check_recompute(self):
        full = self.recompute_granularity == "full"
        if full and self.recompute_method is None:
            self._fail("recompute_method", "must be uniform or block with recompute_granularity=full")
        if full and self.recompute_num_layers is None:
            self._fail("recompute_num_layers", "must be set with recompute_granularity=full")
        if not full:
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    self._fail(name, f"is only for recompute_granularity=full "
                                     f"(recompute_granularity={self.recompute_granularity!r})")
        self._positive("recompute_num_layers", allow_none=True)
        if self.recompute_granularity == "selective":
            modules = self.recompute_module_list
            if "mlp" in modules:
                self._fail("recompute_modules", "mlp is not supported: megatron-core's selective MLP recompute ran "
                                                "out of GPU memory in tests (unbounded nested recomputation); use "
                                                "core_attn or recompute_granularity=full")
            unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
            if not modules or unknown:
                self._fail("recompute_modules", f"must be a comma-separated list of {', '.join(RECOMPUTE_MODULES)}")
            if len(set(modules)) != len(modules):
                self._fail("recompute_modules", "names a module twice")
            if "layernorm" in modules and self.attention != "te":
                # megatron-core (0.16-0.19) checkpoints the norms with CheckpointWithoutOutput, which
                # always takes its FP8 path (``fp8 is not None``) and so needs Transformer Engine.
                self._fail("recompute_modules", "layernorm needs Transformer Engine layers in megatron-core "
                                                "(model.attention=te)")

    @property
    def gemma2_options(self) -> list[str]:
        """The Gemma 2 layer options that are on (they need the local layer spec)."""
        names = ("attention_softcap", "sliding_window", "post_norms", "zero_centered_norm")
        return [n for n in names if getattr(self, n) not in (None, False)]

    @property
    def recompute_module_list(self) -> list[str]:
        return [x.strip() for x in self.recompute_modules.split(",") if x.strip()]

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


@dataclass
class LossConfig(Section):
    """The loss layer: CCE (one of cce_parallel.IMPLS) or megatron-core's own, for comparison."""

    SECTION = "loss"

    impl: Literal[LOSS_IMPLS] = "cce_kahan_full_c"
    """A CCE impl (``cce_kahan_full_c``: the paper's pretraining mode, ∇C unfiltered), or
    megatron-core's ColumnParallelLinear output layer, which builds the logits [s·b, V/tp], followed
    by ``megatron``: vocab_parallel_cross_entropy (unfused: eager PyTorch on an fp32 copy of bf16
    logits), or ``megatron_fused``: the loss GPTModel takes with ``cross_entropy_loss_fusion``
    (implementation: ``loss.fusion_impl``). The native fused loss is the same math in
    torch.compile'd pieces with one all-reduce fewer, and hands back a bf16 logit gradient
    whatever the logits' dtype, so an fp32 run of it follows ``megatron`` closely, not bit for bit."""
    fusion_impl: Literal["auto", "native", "te"] = "auto"
    """megatron-core's ``cross_entropy_fusion_impl`` for ``loss.impl=megatron_fused``: ``native``
    (fused_vocab_parallel_cross_entropy, torch.compile'd; CUDA and CPU), ``te`` (Transformer
    Engine's parallel_cross_entropy; CUDA only), or ``auto``: te where Transformer Engine is
    installed and CUDA is available, else native. Megatron-LM's own argument check now refuses te
    by default (training-stability reports; megatron-core 0.19's config warns when te is set):
    choose native to compare against what Megatron-LM users get."""
    z_loss: float = 0.0
    """Adds z_loss · lse² per token (CCE impls only)."""
    softcap: float | None = None
    """Logit soft-capping softcap · tanh(logit / softcap), Gemma 2 style (CCE impls only)."""
    label_smoothing: float = 0.0
    """Label smoothing over the full padded vocabulary (CCE impls only)."""
    logits_budget: int | Literal["auto", "lean"] = "auto"
    """Bytes of the logits buffer per token block when the loss computes its gradients in the forward
    (the one-pass path, three logit-sized GEMMs; logits in the input dtype, fp32 for fp16): ``auto``
    (a quarter of the micro-batch's logits over this rank's shard where ∇C sums in bf16, all of
    them where it sums in fp32, within 512 MiB .. 3 GiB), a number of bytes, or ``lean`` / 0
    (recompute the logits in the backward: four GEMMs, about 100 MB above ∇E + ∇C) (CCE impls
    only)."""
    kernel_config: dict[str, int] = field(default_factory=dict)
    """Overrides of the CCE kernels' launch settings (fields of ``cce_parallel.kernels.KernelConfig``,
    checked when the run starts), exported as ``CCE_PARALLEL_KERNEL_CONFIG`` unless that variable
    is already set. Empty: the kernels' defaults on GPUs; on CPU the trainer picks large blocks so
    that the Triton interpreter runs few programs (``cce_parallel.train.launch.CPU_KERNEL_CONFIG``)."""

    def __post_init__(self):
        if not self.is_cce:
            # Neither of megatron-core's losses has these options; the CCE-only knobs would be
            # silently ignored, which would make a comparison run differ from what the recipe says.
            for name, default in (("z_loss", 0.0), ("softcap", None), ("label_smoothing", 0.0)):
                if getattr(self, name) != default:
                    self._fail(
                        name, f"is not supported by loss.impl={self.impl} (megatron-core's loss has no such option)"
                    )
        if self.fusion_impl != "auto" and self.impl != "megatron_fused":
            self._fail("fusion_impl", f"only applies to loss.impl=megatron_fused, not loss.impl={self.impl}")
        if not math.isfinite(self.z_loss) or self.z_loss < 0:
            self._fail("z_loss", "must be a finite number >= 0")
        if self.softcap is not None and (not math.isfinite(self.softcap) or self.softcap <= 0):
            self._fail("softcap", "must be a finite number > 0, or null")
        if not 0.0 <= self.label_smoothing < 1.0:
            self._fail("label_smoothing", "must be in [0, 1)")
        if isinstance(self.logits_budget, int) and self.logits_budget < 0:
            self._fail("logits_budget", "must be 'auto', 'lean' or a number of bytes >= 0")
        for key, value in self.kernel_config.items():
            if value < 0:
                raise RecipeError(f"loss.kernel_config.{key}: must be >= 0 (got {value})")

    @property
    def is_cce(self) -> bool:
        """A CCE loss layer (use_cce); otherwise megatron-core's output layer and loss."""
        return self.impl not in MEGATRON_IMPLS


@dataclass
class ParallelConfig(Section):
    """The parallel layout: world size = tensor · pipeline · data."""

    SECTION = "parallel"

    tensor: int = 2
    """Tensor-parallel size: heads, MLP and the vocabulary (of the embedding and the loss) are split."""
    pipeline: int = 1
    """Pipeline-parallel stages (megatron-core's 1F1B schedule; CUDA only)."""
    data: int | None = None
    """Data-parallel size; None: world size / (tensor · pipeline)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism over the tensor-parallel group (CUDA only; needs tensor > 1)."""
    distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (ZeRO-1, megatron-core's
    DistributedOptimizer; CUDA only)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward (megatron DDP buckets; CUDA only)."""
    fsdp: Literal["none", "torch", "megatron"] = "none"
    """Fully sharded data parallelism: parameters, gradients and optimizer state sharded over the
    data-parallel ranks, composing with tensor (and sequence) parallelism and gradient
    accumulation. ``none``: replicated (DDP, or ZeRO-1 with distributed_optimizer); ``torch``:
    PyTorch FSDP2 through megatron-core's TorchFullyShardedDataParallel (CUDA and CPU);
    ``megatron``: megatron-core's Megatron-FSDP (CUDA only; its ZeRO-3 strategy
    optim_grads_params, fp32 gradient shards, its distributed optimizer)."""

    def __post_init__(self):
        self._positive("tensor", "pipeline")
        self._positive("data", allow_none=True)
        if self.sequence_parallel and self.tensor == 1:
            self._fail("sequence_parallel", "needs parallel.tensor > 1")
        if self.fsdp != "none":
            engine = {"torch": "megatron-core's torch FSDP2 wrapper", "megatron": "Megatron-FSDP"}[self.fsdp]
            for name, value, why in (
                ("distributed_optimizer", self.distributed_optimizer, "FSDP shards the optimizer state itself"),
                ("overlap_grad_reduce", self.overlap_grad_reduce,
                 "a megatron DDP option; FSDP overlaps its reduce-scatters itself"),
                ("pipeline", self.pipeline > 1, f"{engine} has no pipeline stages"),
            ):
                if value:
                    shown = f"{self.pipeline}" if name == "pipeline" else "true"
                    self._fail("fsdp", f"{self.fsdp} with parallel.{name}={shown} is not supported ({why})")


@dataclass
class TrainConfig(Section):
    """Batch sizes, length of the run, precision."""

    SECTION = "train"

    steps: int = 50
    """Optimizer steps of the whole run (the learning-rate schedule spans them)."""
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
    deterministic: bool = False
    """Bitwise reproducible GPU runs (same recipe, seed and layout; a resumed run equals one that
    never stopped): deterministic torch kernels (embedding and attention backward included),
    megatron-core's deterministic_mode, a fixed NCCL algorithm (NCCL_ALGO=Ring unless set) and
    CUBLAS_WORKSPACE_CONFIG. Costs some throughput (see docs). CPU runs are deterministic anyway."""

    def __post_init__(self):
        self._positive("steps", "micro_batch_size", "global_batch_size")
        self._positive("grad_accumulation", "stop_at", allow_none=True)
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
    """Steps of warmup + decay; None: train.steps."""
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


@dataclass
class Recipe:
    """A whole run. The defaults are the ``tiny`` recipe."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        m, p, t, o = self.model, self.parallel, self.train, self.optim
        if m.num_attention_heads % p.tensor:
            raise RecipeError(
                f"model.num_attention_heads: {m.num_attention_heads} heads do not split over parallel.tensor={p.tensor}"
            )
        if m.query_groups % p.tensor:
            raise RecipeError(
                f"model.num_query_groups: {m.query_groups} key/value heads do not split over parallel.tensor={p.tensor}"
            )
        if m.ffn_size % p.tensor:
            raise RecipeError(f"model.ffn_hidden_size: {m.ffn_size} does not split over parallel.tensor={p.tensor}")
        if m.num_layers % p.pipeline:
            raise RecipeError(
                f"model.num_layers: {m.num_layers} layers do not split over parallel.pipeline={p.pipeline} stages"
            )
        stage_layers = m.num_layers // p.pipeline
        if m.recompute_num_layers is not None and m.recompute_num_layers > stage_layers:
            raise RecipeError(
                f"model.recompute_num_layers: {m.recompute_num_layers} is more than the {stage_layers} layers "
                f"of a pipeline stage (model.num_layers={m.num_layers} / parallel.pipeline={p.pipeline})"
            )
        if p.sequence_parallel and m.seq_length % p.tensor:
            raise RecipeError(
                f"model.seq_length: {m.seq_length} does not split over parallel.tensor={p.tensor} "
                "(parallel.sequence_parallel)"
            )
        if p.data is not None:
            self.batch_layout(p.data)
        decay = o.decay_steps if o.decay_steps is not None else t.steps
        if o.warmup_steps >= decay and o.schedule != "constant":
            raise RecipeError(
                f"optim.warmup_steps: {o.warmup_steps} warmup steps leave no decay within "
                f"{'optim.decay_steps' if o.decay_steps is not None else 'train.steps'}={decay}"
            )
        if t.stop_at is not None and t.stop_at > t.steps:
            raise RecipeError(f"train.stop_at: {t.stop_at} is past train.steps={t.steps}")

    # -- sizes that depend on the launch -----------------------------------------------------

    def data_parallel_size(self, world_size: int) -> int:
        """parallel.data, or what the world size leaves for it; RecipeError if they disagree."""
        p = self.parallel
        model_parallel = p.tensor * p.pipeline
        if p.data is not None:
            if model_parallel * p.data != world_size:
                raise RecipeError(
                    f"parallel.data: tensor {p.tensor} x pipeline {p.pipeline} x data {p.data} = "
                    f"{model_parallel * p.data} ranks, but the world size is {world_size}"
                )
            return p.data
        if world_size % model_parallel:
            raise RecipeError(
                f"parallel.tensor: tensor {p.tensor} x pipeline {p.pipeline} = {model_parallel} does not "
                f"divide the world size {world_size}"
            )
        return world_size // model_parallel

    def batch_layout(self, dp: int) -> int:
        """Micro-batches per step per rank for data-parallel size dp; RecipeError if the sizes disagree."""
        t = self.train
        per_step = t.micro_batch_size * dp
        if t.grad_accumulation is not None:
            if per_step * t.grad_accumulation != t.global_batch_size:
                raise RecipeError(
                    f"train.global_batch_size: {t.global_batch_size} != micro_batch_size {t.micro_batch_size} "
                    f"x grad_accumulation {t.grad_accumulation} x data-parallel size {dp} = {per_step * t.grad_accumulation}"
                )
            return t.grad_accumulation
        if t.global_batch_size % per_step:
            raise RecipeError(
                f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size "
                f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}"
            )
        return t.global_batch_size // per_step

    def check_world(self, world_size: int, device: str) -> tuple[int, int]:
        """Check the recipe against the launch; return (data-parallel size, grad accumulation)."""
        dp = self.data_parallel_size(world_size)
        accumulation = self.batch_layout(dp)
        if device != "cuda":
            p = self.parallel
            for name, value, ok in (
                ("pipeline", p.pipeline, 1),
                ("sequence_parallel", p.sequence_parallel, False),
                ("distributed_optimizer", p.distributed_optimizer, False),
                ("overlap_grad_reduce", p.overlap_grad_reduce, False),
            ):
                if value != ok:
                    raise RecipeError(
                        f"parallel.{name}: {value!r} needs CUDA (megatron-core's implementation allocates on "
                        f"the GPU); on CPU use parallel.{name}={ok!r}"
                    )
            if p.fsdp == "megatron":
                raise RecipeError(
                    "parallel.fsdp: megatron (Megatron-FSDP) needs CUDA (it runs its gathers and reduce-scatters "
                    "on CUDA streams); on CPU use parallel.fsdp=torch"
                )
            if self.train.precision == "bf16":
                raise RecipeError("train.precision: bf16 needs CUDA (the Triton interpreter on CPU is fp32 only)")
            if self.model.attention == "te":
                raise RecipeError("model.attention: te (Transformer Engine) needs CUDA; use sdpa or auto")
            if self.loss.fusion_impl == "te":
                raise RecipeError(
                    "loss.fusion_impl: te (Transformer Engine's parallel_cross_entropy, a Triton kernel) needs "
                    "CUDA; use native or auto for loss.impl=megatron_fused on CPU"
                )
            if self.model.recompute_granularity is not None:
                raise RecipeError(
                    f"model.recompute_granularity: {self.model.recompute_granularity} needs CUDA (megatron-core's "
                    "checkpoint saves and restores the CUDA RNG state); use null on CPU"
                )
        return dp, accumulation

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps if self.optim.decay_steps is not None else self.train.steps


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}
