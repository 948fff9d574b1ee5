"""`linear_cross_entropy`: input checks, the targets' pass, dispatch, reduction.

Every check of shapes, dtypes and options runs before any kernel, and each error names the offending
argument. The targets' values are checked once the loss's kernels are queued (TargetCheck).
"""

import math
import os
import warnings
from numbers import Real
from typing import Callable, Optional, Union

import torch

from cce_parallel.ops import upstream
from cce_parallel.ops.upstream import UpstreamState
from cce_parallel.ops.autograd import LinearCrossEntropyFunction
from cce_parallel.ops.common import IMPL_TRAITS, SINGLE, Collectives, LossConfig, fused_one_pass

IMPLS = tuple(IMPL_TRAITS)
REDUCTIONS = ("none", "sum", "mean")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# "auto" logits budget: the call's logits (over the largest shard, in the buffer's dtype) in
# AUTO_BUDGET_PARTS token blocks where dC is summed in bf16, in one where it is summed in fp32
# (into Megatron's main_grad, fp16, label smoothing), each block within AUTO_BUDGET bytes.
# Measured on an H100 (docs/internals.md, "Which budget"): with dC summed in bf16, four blocks of Llama 3 8B,
# Qwen 2.5 7B or Gemma 2 2B at 8,192 tokens take 0.4-1.6 GB less than one or two, for 1-4 % more
# time; more blocks of less than 512 MiB slow the dC GEMMs (Gemma 2 2B: +12 % at eight). An fp32
# sum reads and writes V x D x 4 bytes per block. The cap keeps very long calls' buffers bounded.
AUTO_BUDGET = (512 << 20, 3 << 30)
AUTO_BUDGET_PARTS = 4


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def resolve_logits_budget(budget, logits_bytes: int = 0, *, bf16_dc: bool = True) -> int:
    """Bytes of the one-pass logits buffer per token block: "auto" (the default: `logits_bytes`,
    the call's logits over the largest shard in the buffer's dtype, in AUTO_BUDGET_PARTS blocks
    when dC sums in bf16 (bf16_dc), else in one, within AUTO_BUDGET), "lean" or 0 (the lean path),
    or a positive int."""
    if budget == "auto":
        lo, hi = AUTO_BUDGET
        return min(max(logits_bytes // (AUTO_BUDGET_PARTS if bf16_dc else 1), lo), hi)
    if budget == "lean":
        return 0
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"logits_budget must be 'auto', 'lean' or a number of bytes >= 0, got {budget!r}")
    return budget


def _interpreted() -> bool:
    """Whether triton was imported under TRITON_INTERPRET=1: its jit functions are then the
    interpreter's (the flag is read when a function is decorated, for triton's own at import)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def _triton_usable(impl: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels run for this device and dtype; otherwise warn once and use PyTorch."""
    if not IMPL_TRAITS[impl].triton:
        return False
    reason = None
    try:
        import triton  # noqa: F401
    except ImportError:
        reason = "triton is not installed"
    if reason is None and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        reason = "CPU tensors need TRITON_INTERPRET=1 (set before triton is imported) to run the kernels"
    if reason is None and device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            "cce_parallel: TRITON_INTERPRET=1 was set after triton was imported (by your script or by a "
            "package such as megatron.core), so triton's own functions are compiled ones and the kernels "
            "would fail with \"Cannot call @triton.jit'd outside of the scope of a kernel\". Set it before "
            "anything imports triton: first thing in the script, or TRITON_INTERPRET=1 in the environment."
        )
    if reason is None and device.type == "cpu" and dtype != torch.float32:
        reason = f"the Triton interpreter (CPU) runs the kernels in float32 only, not {dtype}"
    if reason is None and device.type not in ("cpu", "cuda"):
        reason = f"no Triton kernels for device type {device.type!r}"
    if reason is None:
        return True
    # Python's warning filter shows it once per call site.
    warnings.warn(f"cce_parallel: impl={impl!r} falls back to impl='torch': {reason}", stacklevel=3)
    return False


def check_inputs(
    e, c, targets, bias, *, ignore_index, softcap, label_smoothing, z_loss, reduction, impl, logits_budget="auto",
    loss_scale=None, row_ranks=1, weights=None, temperature=1.0, return_entropy=False, entropy_weights=None,
):
    """Raise a clear error for any malformed argument (no tensor data is read here).

    row_ranks: under sequence parallelism e holds 1/row_ranks of the rows targets covers.
    """
    for name, t in (("e", e), ("c", c), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("bias", bias), ("weights", weights)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if entropy_weights is not None and not isinstance(entropy_weights, torch.Tensor):
        if not _is_real(entropy_weights) or not math.isfinite(entropy_weights):
            raise TypeError(f"entropy_weights must be a finite number, a tensor or None, got {entropy_weights!r}")
        entropy_weights = None  # one number: nothing more to check
    if impl not in IMPL_TRAITS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    if softcap is not None and (not _is_real(softcap) or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a finite positive number or None, got {softcap!r}")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite positive number, got {temperature!r}")
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {return_entropy!r}")
    if not _is_real(label_smoothing) or not (0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if not _is_real(z_loss) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    resolve_logits_budget(logits_budget)
    if loss_scale is not None:
        upstream.check_loss_scale(loss_scale)

    if e.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"e must be float32, float16 or bfloat16, got dtype {e.dtype}")
    if c.dtype != e.dtype:
        raise TypeError(f"mixed dtypes: e is {e.dtype} but c is {c.dtype}")
    if bias is not None and bias.dtype != e.dtype:
        raise TypeError(f"mixed dtypes: e is {e.dtype} but bias is {bias.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    for name, t in (("weights", weights), ("entropy_weights", entropy_weights)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    for name, t in (("c", c), ("targets", targets), ("bias", bias), ("weights", weights),
                    ("entropy_weights", entropy_weights)):
        if t is not None and t.device != e.device:
            raise ValueError(f"mixed devices: e is on {e.device} but {name} is on {t.device}")

    if c.dim() != 2:
        raise ValueError(f"c must be 2-D [V, D], got shape {tuple(c.shape)}")
    if e.dim() < 1 or e.shape[-1] != c.shape[1]:
        raise ValueError(f"shape mismatch: e {tuple(e.shape)} must end in D={c.shape[1]} (c is {tuple(c.shape)})")
    rows = (e.shape[0] * row_ranks, *e.shape[1:-1]) if e.dim() > 1 else ()
    if tuple(targets.shape) != rows:
        what = "e.shape[:-1]" if row_ranks == 1 else f"e.shape[:-1] with dim 0 times {row_ranks} (sequence parallel)"
        raise ValueError(f"shape mismatch: targets {tuple(targets.shape)} must equal {what} = {rows}")
    for name, t in (("weights", weights), ("entropy_weights", entropy_weights)):
        if t is not None and t.shape != targets.shape:
            raise ValueError(f"shape mismatch: {name} {tuple(t.shape)} must equal targets' shape {tuple(targets.shape)}")
    if bias is not None and tuple(bias.shape) != (c.shape[0],):
        raise ValueError(f"bias must have shape ({c.shape[0]},) to match c's V, got {tuple(bias.shape)}")
    if c.shape[0] == 0:
        raise ValueError("c has an empty vocabulary (V = 0)")


def prepare_targets(
    targets, ignore_index: int, vocab: int, start: int, shard: int, per_kept: bool, use_triton: bool
):
    """(local, keep, counts, scale) of the flat targets, as kernels.prepare_targets defines them:
    one Triton launch on the Triton path, the same from PyTorch ops otherwise. No host sync."""
    if use_triton:
        from cce_parallel.kernels.targets import prepare_targets as launch

        return launch(targets, ignore_index, vocab, start, shard, per_kept)
    t = targets.long()
    keep = t != ignore_index
    local = torch.where(keep & (t >= start) & (t < start + shard), t - start, -1)
    n_keep = keep.sum()
    counts = torch.stack([n_keep, (keep & ((t < 0) | (t >= vocab))).sum()])
    one = torch.ones((), device=t.device, dtype=torch.float32)
    return local, keep, counts, one / n_keep.clamp(min=1) if per_kept else one


class TargetCheck:
    """Every tensor-parallel rank's count of bad targets on its way to the host: copied without
    blocking as soon as they are known on the device (`watch`, called by the autograd Function:
    after the targets' pass with one rank, after the first all-reduce with several; see
    ops/common.py's _BadTargets), read by `raise_if_bad` after the loss's forward is queued.
    Waiting then costs the GPU no idle: the copy sits ahead of most of the loss's kernels in the
    stream. Every rank reads every rank's count, so they all raise, and none is left waiting for
    the others in its next collective. Kernels treat a target outside [0, vocab) like one held by
    another rank, so running them before the check is harmless."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.event = self.host = None

    def watch(self, bad: torch.Tensor):
        """bad: int64 [world], each rank's count of kept targets outside [0, vocab), in rank order."""
        if bad.is_cuda:
            self.host = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
            self.host.copy_(bad, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = bad

    def raise_if_bad(self, targets, vocab_size: int, ignore_index: int):
        """ValueError naming a target outside [0, vocab_size) that is not ignore_index, on every rank
        if any rank has one: the rank that has it names a value, the others name that rank."""
        if self.event is not None:
            self.event.synchronize()
        counts = self.host.tolist()
        if not any(counts):
            return
        rule = f"targets must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}"
        ranks = [r for r, n in enumerate(counts) if n]
        mine = counts[self.rank]
        if not mine:
            raise ValueError(
                f"{rule}; tensor-parallel rank(s) {ranks} have {sum(counts)} targets that do not "
                f"(the error there names one); this rank ({self.rank}) has none"
            )
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
        value = targets[bad].reshape(-1)[0].item()
        where = f" on tensor-parallel rank {self.rank}; rank(s) with any: {ranks}" if len(counts) > 1 else ""
        raise ValueError(f"{rule}; found {value} ({mine} such targets{where})")


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    impl: str = "cce",
    logits_budget: Union[str, int] = "auto",
    loss_scale: Optional[float] = None,
    return_lse: bool = False,
    weights: Optional[torch.Tensor] = None,
    state: Optional[UpstreamState] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_weights: Union[float, torch.Tensor, None] = None,
):
    """Cross-entropy of the logits e @ c.T (+ bias) without materializing them, on one device.

    Args:
        e: [..., D] hidden states (float32, float16 or bfloat16).
        c: [V, D] classifier, same dtype and device.
        targets: [...] integer class indices, equal to e.shape[:-1].
        bias: optional [V] classifier bias.
        ignore_index: targets equal to it contribute no loss and no gradient.
        softcap: Gemma 2 style soft-capping, logits become softcap * tanh(logits / softcap).
        label_smoothing: in [0, 1), as in torch.nn.functional.cross_entropy.
        z_loss: adds z_loss * lse**2 per token.
        temperature: the logits are divided by it, before the softcap.
        return_entropy: also return each token's entropy (see parallel/api.py).
        entropy_weights: add each token's entropy times them to its loss (see parallel/api.py).
        The rest: as cce_parallel.linear_cross_entropy (parallel/api.py), without tensor parallelism.
    """
    return sharded_linear_cross_entropy(
        e, c, targets, bias=bias, ignore_index=ignore_index, softcap=softcap, label_smoothing=label_smoothing,
        z_loss=z_loss, reduction=reduction, impl=impl, logits_budget=logits_budget, loss_scale=loss_scale,
        return_lse=return_lse, weights=weights, state=state, temperature=temperature,
        return_entropy=return_entropy, entropy_weights=entropy_weights,
    )


def sharded_linear_cross_entropy(
    e,
    c,
    targets,
    *,
    bias=None,
    ignore_index=-100,
    softcap=None,
    label_smoothing=0.0,
    z_loss=0.0,
    reduction="mean",
    impl="cce",
    logits_budget="auto",
    loss_scale=None,
    return_lse=False,
    weights=None,
    state: Optional[UpstreamState] = None,
    temperature=1.0,
    return_entropy=False,
    entropy_weights=None,
    comm: Collectives = SINGLE,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    sequence_parallel: bool = False,
    world: int = 1,
    c_main_grad: Optional[Callable[[], torch.Tensor]] = None,
    largest_shard: Optional[int] = None,
):
    """`linear_cross_entropy` where c holds rows [vocab_start, vocab_start + V_shard) of a
    vocab_size vocabulary and `comm` reaches the ranks holding the rest (parallel/ builds those).

    With sequence_parallel, e holds this rank's 1/world of the rows (dim 0) that targets covers.
    largest_shard: the most classifier rows any rank holds; it sets the one-pass token blocks, which
    must be the same on every rank (their statistics are all-reduced block by block).
    c_main_grad: a callable returning a buffer like c into which dC is added in the backward
    (Megatron's gradient-accumulation fusion); c then gets no gradient.
    """
    check_inputs(
        e, c, targets, bias, ignore_index=ignore_index, softcap=softcap, label_smoothing=label_smoothing,
        z_loss=z_loss, reduction=reduction, impl=impl, logits_budget=logits_budget, loss_scale=loss_scale,
        row_ranks=world if sequence_parallel else 1, weights=weights, temperature=temperature,
        return_entropy=return_entropy, entropy_weights=entropy_weights,
    )
    shard = c.shape[0]
    fused = fused_one_pass(e.dtype, softcap, label_smoothing)
    # The one-pass path sums dC in bf16 (no fp32 main_grad to take it): see ops/one_pass.py. Once the
    # caller's state has seen masked per-token weights in a backward, its per-token calls make dC
    # and dE in fp32 instead, so that their backwards can subtract the masked rows' part.
    fp32_grads = reduction == "none" and state is not None and state.masked_weights_seen
    # Once it has seen weights that were no mask, dC and dbias wait for the backward (defer_dc).
    defer_dc = reduction == "none" and state is not None and state.per_token_weights_seen
    fp32_grads = fp32_grads and not defer_dc
    bf16_dc = (fused and not label_smoothing and c_main_grad is None and e.dtype != torch.float32
               and not fp32_grads and not defer_dc)
    budget = resolve_logits_budget(
        logits_budget, targets.numel() * max(shard, largest_shard or 0) * (e.element_size() if fused else 4),
        bf16_dc=bf16_dc or defer_dc,  # a deferred dC sums in bf16 in the backward
    )
    vocab = vocab_size if vocab_size is not None else shard
    out_shape = targets.shape
    e2 = e.reshape(-1, e.shape[-1])
    t2 = targets.reshape(-1).contiguous()
    use_triton = _triton_usable(impl, e.device, e.dtype)
    # The targets' pass runs inside the Function, on the one-pass path once the first block's GEMM
    # is queued; every rank's count of bad targets reaches the host while the loss's kernels run,
    # and is checked once they are queued: no host sync before the GPU has work. The one-pass
    # gradients are made for the loss's mean over the kept tokens for reduction "none" too:
    # Megatron's (loss * mask).sum() / mask.sum(), the mask folded into ignore_index, then needs no
    # pass over dC in the backward.
    check = TargetCheck(comm.rank)
    # A bf16 dC is made for the caller's loss_scale, as given, or else for the state's (ops/upstream.py;
    # 1 without a state); other one-pass gradients scale exactly, so they are made for 1.
    given = loss_scale is not None and bf16_dc
    loss_scale = float(loss_scale) if given else state.loss_scale if bf16_dc and state is not None else 1.0
    # Per-token weights, fp32, 0 at ignored tokens; "mean" divides by their sum over the kept tokens.
    w2 = w_sum = h2 = None
    if weights is not None:
        w2 = torch.where(t2 != ignore_index, weights.reshape(-1).float(), 0.0)
        w_sum = w2.sum() if reduction == "mean" else None
    if entropy_weights is not None:  # the entropies' weights, fp32, 0 at ignored tokens
        h = entropy_weights.reshape(-1).float() if isinstance(entropy_weights, torch.Tensor) else float(entropy_weights)
        h2 = torch.where(t2 != ignore_index, h, 0.0)

    def prepare():
        local, keep, counts, scale = prepare_targets(t2, ignore_index, vocab, vocab_start, shard,
                                                     reduction != "sum", use_triton)
        if w_sum is not None:  # weights summing to 0 (nothing kept, say): zero gradients, as for no tokens
            scale = torch.where(w_sum != 0, 1.0 / w_sum, 0.0)
        if loss_scale != 1.0:  # the one-pass gradients are made for the expected upstream number
            scale = scale * loss_scale
        return local, keep, counts, scale

    kernel_cfg = None
    if use_triton:
        from cce_parallel.kernels.config import default_config

        kernel_cfg = default_config(e.device, e.dtype)
    need = (e.requires_grad, c.requires_grad, bias is not None and bias.requires_grad)
    cfg = LossConfig(
        impl=impl,
        softcap=float(softcap) if softcap is not None else None,
        temperature=float(temperature),
        entropy=bool(return_entropy) or entropy_weights is not None,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        vocab_size=vocab,
        use_triton=use_triton,
        kernel=kernel_cfg,
        logits_budget=budget,
        block_vocab=largest_shard or shard,
        one_pass=use_triton and budget > 0 and torch.is_grad_enabled() and any(need)
        and not (state is not None and bf16_dc and not given and state.loss_scale_unsteady),
        need_de=need[0],
        need_dc=need[1],
        need_db=need[2],
        loss_scale=loss_scale,
        loss_scale_given=given,
        fp32_grads=fp32_grads,
        defer_dc=defer_dc,
    )
    # The kernels take row strides for e and c but assume unit strides elsewhere.
    c_k = c if c.stride(-1) == 1 else c.contiguous()
    bias_k = bias.contiguous() if bias is not None else None
    loss, lse, counts, entropy = LinearCrossEntropyFunction.apply(
        e2.contiguous(), c_k, bias_k, t2, w2, h2, vocab_start, prepare, check.watch, cfg, comm, sequence_parallel,
        c_main_grad, state,
    )
    check.raise_if_bad(targets, vocab, ignore_index)
    if state is not None:
        # Earlier backwards' reports (the loss scale), for the calls after this one: queued before
        # this call's targets, they have arrived by now. Waiting for them before the forward instead
        # would let the GPU drain between back-to-back calls (Phi 3.5 mini: +6 %).
        state.read_reports()
    if reduction == "none":
        loss = loss.reshape(out_shape)
    elif reduction == "sum":
        loss = loss.sum()
    else:  # NaN when every token is ignored (or the weights sum to 0), as in PyTorch
        loss = loss.sum() / (counts[0] if w_sum is None else w_sum)
    extra = ([lse.reshape(out_shape)] if return_lse else []) + ([entropy.reshape(out_shape)] if return_entropy else [])
    return (loss, *extra) if extra else loss
