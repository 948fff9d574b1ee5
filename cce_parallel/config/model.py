"""The recipe's sections of what is trained and how it is split: ``model`` (the GPT: sizes,
variants, recomputation), ``loss`` (a CCE impl or megatron-core's own) and ``parallel`` (tensor,
pipeline and data parallelism, FSDP), with the lists of loss impls and recomputable modules. Each
section checks its own fields in ``__post_init__``; the checks across sections are ``Recipe``'s
(schema.py). No torch and no kernels.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

from cce_parallel.config.section import RecipeError, Section

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
    mtp_num_layers: int | None = None
    """Multi-token prediction (DeepSeek-V3; megatron-core's MTP): this many extra layers on the last
    pipeline stage, layer k predicting the token k + 1 places ahead through the shared output layer
    (with a CCE loss, each depth's loss is CCE's too: no logits per depth). Each depth's masked mean
    loss, times mtp_loss_scaling_factor / mtp_num_layers, is added to the training loss (not to the
    logged lm loss). CUDA only (megatron-core's MTP loss tracker allocates on the GPU). None: off."""
    mtp_loss_scaling_factor: float = 0.1
    """The weight of the MTP losses (megatron-core's default): their mean over the depths is added
    to the loss times this. Only with mtp_num_layers."""

    def __post_init__(self):
        self._positive("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                       "make_vocab_size_divisible_by", "rotary_base", "layernorm_epsilon", "init_method_std")
        self._positive("num_query_groups", "kv_channels", "ffn_hidden_size", "max_position_embeddings",
                       "vocab_size", allow_none=True)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            self._fail("num_attention_heads", f"must divide hidden_size={self.hidden_size} (or set model.kv_channels)")
        if self.position_embedding == "rope" and self.head_dim % 2:
            # Rotary embeddings turn pairs of channels; megatron-core's would fail in the first step
            # ("The size of tensor a (15) must match the size of tensor b (16)").
            key = "kv_channels" if self.kv_channels is not None else "num_attention_heads"
            self._fail(key, f"gives a head size of {self.head_dim} (hidden_size={self.hidden_size} / "
                            f"num_attention_heads={self.num_attention_heads}, or kv_channels); rotary embeddings "
                            "(position_embedding=rope) need an even head size")
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
        self._positive("mtp_num_layers", allow_none=True)
        if not math.isfinite(self.mtp_loss_scaling_factor) or self.mtp_loss_scaling_factor < 0:
            self._fail("mtp_loss_scaling_factor", "must be a finite number >= 0")
        if self.mtp_num_layers is None and self.mtp_loss_scaling_factor != 0.1:
            self._fail("mtp_loss_scaling_factor", "only applies with model.mtp_num_layers (multi-token prediction)")
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
