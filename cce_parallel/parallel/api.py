"""The public loss: one device, or a vocabulary shard per tensor-parallel rank."""

from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from cce_parallel.ops.functional import check_inputs, sharded_linear_cross_entropy
from cce_parallel.ops.upstream import UpstreamState
from cce_parallel.parallel import dtensor
from cce_parallel.parallel.collectives import GroupCollectives
from cce_parallel.parallel.vocab import agree_on_layout


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    impl: str = "cce",
    logits_budget: Union[str, int] = "auto",
    loss_scale: Optional[float] = None,
    return_lse: bool = False,
    return_entropy: bool = False,
    weights: Optional[torch.Tensor] = None,
    entropy_weights: Union[float, torch.Tensor, None] = None,
    state: Optional[UpstreamState] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_range: Optional[Tuple[int, int]] = None,
    sequence_parallel: bool = False,
    main_grad: Union[torch.Tensor, Callable[[], torch.Tensor], None] = None,
):
    """Cross-entropy of the logits e @ c.T (+ bias) without materializing them.

    Args:
        e: [..., D] hidden states (float32, float16 or bfloat16). With sequence_parallel, this
            rank's slice along dim 0 (Megatron's [s/tp, b, h]).
        c: [V, D] classifier, same dtype and device; with tp_group, this rank's rows of it.
        targets: [...] integer class ids in the full vocabulary, shaped like e.shape[:-1] (with
            sequence_parallel: like the gathered e, i.e. the full sequence).
        bias: optional classifier bias, [V] (or this rank's shard of it).
        ignore_index: targets equal to it contribute no loss and no gradient.
        softcap: Gemma 2 style soft-capping, logits become softcap * tanh(logits / softcap).
        temperature: the logits are divided by it before the softcap: softcap * tanh(x / T / softcap)
            with both. Everything (loss, lse, gradients) is of those logits, as a sampler at
            temperature T sees them: e.g. the target log-probs of a rollout, -loss with
            reduction="none". Finite and positive.
        label_smoothing: in [0, 1), as in torch.nn.functional.cross_entropy, over the full vocabulary.
        z_loss: adds z_loss * lse**2 per token (lse over the full vocabulary).
        reduction: "none" (fp32, shaped like targets), "sum" or "mean" (over non-ignored tokens;
            with weights, sum(weights * loss) / sum(weights) over them, as torch's `weight`).
        impl: one of IMPLS (see docs/internals.md, "Which path, and which impl").
        logits_budget: bytes of the logits buffer per token block when gradients are computed in
            the forward (the one-pass path; logits in the input dtype, fp32 for fp16 inputs):
            "auto" (a quarter of the call's logits where dC sums in bf16, all of them where it
            sums in fp32, within 512 MiB .. 3 GiB), a number of bytes, or "lean" / 0 for the
            two-pass path that recomputes the logits in the backward (about 100 MB above dE + dC).
        loss_scale: the number the loss (its mean over the kept tokens, for reduction "none") is
            multiplied by before its backward, e.g. 1 / micro-batches: a bf16 dC (and dE) made in
            the forward is made for it, rounded once. Used as given; a backward that brings
            another number still gets exact gradients (recomputed, slower). None: the state's
            (learned from its backwards), or 1 without a state. Finite and nonzero.
        return_lse: also return the per-token log-sum-exp (fp32, shaped like targets, 0 where
            ignored); it is differentiable.
        return_entropy: also return each token's entropy of the softmax of its (tempered,
            soft-capped) logits over the full vocabulary, lse - sum_v p_v z_v (fp32, shaped like
            targets, 0 where ignored; not multiplied by weights); it is differentiable. Its sum
            over the vocabulary is all-reduced with the statistics under tensor parallelism, never
            gathered. A backward that uses it recomputes the gradients (the lean path), exact;
            entropy_weights put it in the loss instead, at no such cost.
        weights: per-token weights known before the forward (a loss mask, SFT token weights, RL
            advantages), shaped like targets, any float dtype, any sign: each kept token's loss
            is multiplied by its weight, and the one-pass gradients are made for the weighted
            loss in the same pass (three GEMMs, as the plain mean). Multiplying a
            reduction="none" loss by weights afterwards gives the same numbers but costs a
            recompute of ∇c in the backward. A weights tensor that requires grad gets the
            per-token loss as its gradient.
        entropy_weights: a number, or per-token weights shaped like targets, known before the
            forward (an RL entropy bonus is negative: -0.01 / N with reduction="sum" for
            -0.01 * entropy.mean()): each kept token's loss becomes weights * loss +
            entropy_weights * entropy, the entropy as return_entropy gives it, and the one-pass
            gradients are made for that in the same pass (W's entries rescaled in one more pass
            over the block's logits buffer). reduction applies to that sum; "mean" divides by the
            same count (or sum of weights) as without it. A tensor that requires grad gets the
            per-token entropy as its gradient.
        state: an UpstreamState that keeps what this loss learns from its backwards (how the
            upstream gradient was weighted, the loss scale) and records the paths taken;
            LinearCrossEntropy and the Megatron layer pass their own. None (a plain call):
            nothing is learned, and the call's path follows from its arguments alone.
        tp_group: the tensor-parallel ProcessGroup whose ranks each hold a shard of c.
        vocab_range: (start, stop) rows of the full classifier this rank holds; default: equal,
            contiguous shards in rank order.
        sequence_parallel: e is sequence-parallel: gathered before the loss, its gradient
            reduce-scattered back.
        main_grad: a tensor shaped like c, fp32 usually (or a callable returning one at backward
            time), into which the backward adds ∇c from its fp32 accumulator, as Megatron's
            gradient-accumulation fusion does; c.grad is then left as it is. None: c gets its
            gradient as usual.

    c (with bias) may be a torch DTensor: Shard(0) on one mesh dimension gives tp_group and
    vocab_range, Replicate is a whole classifier; e may then be a DTensor too, Replicate or Shard(0)
    (sequence parallel). Gradients come back as DTensors placed like their inputs (parallel/dtensor.py).

    Returns:
        loss, or (loss, lse) when return_lse, (loss, entropy) when return_entropy, (loss, lse,
        entropy) with both; identical on every rank of tp_group.
    """
    dtensor_error = None
    if dtensor.any_dtensor(e, c, targets, bias):
        e, c, targets, bias, tp_group, vocab_range, sequence_parallel, dtensor_error = dtensor.unwrap(
            e, c, targets, bias, tp_group, vocab_range, sequence_parallel
        )
    options = dict(
        bias=bias, ignore_index=ignore_index, softcap=softcap, temperature=temperature,
        label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction, impl=impl, logits_budget=logits_budget,
        loss_scale=loss_scale, return_lse=return_lse, return_entropy=return_entropy, weights=weights,
        entropy_weights=entropy_weights, state=state, c_main_grad=_main_grad_source(main_grad, c),
    )
    if tp_group is None:
        if vocab_range is not None or sequence_parallel:
            raise ValueError("vocab_range and sequence_parallel need a tp_group")
        return sharded_linear_cross_entropy(e, c, targets, **options)

    # Check this rank's own inputs first, but raise only after every rank has reported.
    world = dist.get_world_size(tp_group)
    local_error = None
    try:
        if dtensor_error is not None:
            raise dtensor_error
        check_inputs(
            e, c, targets, bias, ignore_index=ignore_index, softcap=softcap, label_smoothing=label_smoothing,
            z_loss=z_loss, reduction=reduction, impl=impl, logits_budget=logits_budget, loss_scale=loss_scale,
            row_ranks=world if sequence_parallel else 1, weights=weights, temperature=temperature,
            return_entropy=return_entropy, entropy_weights=entropy_weights,
        )
        if vocab_range is not None:
            if len(vocab_range) != 2 or not all(isinstance(x, int) for x in vocab_range):
                raise ValueError(f"vocab_range must be a pair of ints (start, stop), got {vocab_range!r}")
        if sequence_parallel and e.dim() < 2:
            raise ValueError("sequence_parallel needs e with a sequence dimension: [s/tp, ..., D]")
    except (TypeError, ValueError) as err:
        local_error = err
    layout = agree_on_layout(tp_group, e, c, targets, vocab_range, sequence_parallel, local_error)
    return sharded_linear_cross_entropy(
        e, c, targets, **options, comm=GroupCollectives(tp_group), vocab_start=layout.start,
        vocab_size=layout.vocab_size, sequence_parallel=sequence_parallel, world=layout.world,
        largest_shard=layout.largest_shard,
    )


def _main_grad_source(main_grad, c):
    """None, or a callable giving the buffer ∇c is added into (checked when it is used)."""
    if main_grad is None:
        return None
    shape = tuple(c.shape) if isinstance(c, torch.Tensor) else None

    def check(buf):
        if not isinstance(buf, torch.Tensor) or not buf.is_floating_point() or tuple(buf.shape) != shape:
            what = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"main_grad must be a floating-point tensor shaped like c {shape}; got {what}")
        return buf

    if isinstance(main_grad, torch.Tensor):
        buffer = check(main_grad)
        return lambda: buffer
    if not callable(main_grad):
        raise TypeError(f"main_grad must be a tensor, a callable returning one, or None; got {type(main_grad).__name__}")
    return lambda: check(main_grad())


class LinearCrossEntropy(torch.nn.Module):
    """Cut cross-entropy loss with fixed options; forward(e, c, targets, bias=None, weights=None,
    entropy_weights=None).

    Takes the same keyword options as `cce_parallel.linear_cross_entropy`, tp_group and loss_scale
    included (held in `options`, shown in its repr). It owns an UpstreamState, `state`: what its own
    backwards taught it (per-token weights that came only in the backward send its later
    reduction="none" calls down the lean path; the loss scale), and the paths its calls took, also
    shown in its repr. `reset_state()` forgets it. Another instance, or a plain function call, never
    sees it.
    """

    def __init__(self, **options):
        super().__init__()
        allowed = set(linear_cross_entropy.__kwdefaults__) - {"bias", "weights", "entropy_weights", "state"}
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"LinearCrossEntropy got unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        self.options = options
        self.state = UpstreamState()

    def forward(self, e, c, targets, bias=None, weights=None, entropy_weights=None):
        return linear_cross_entropy(e, c, targets, bias=bias, weights=weights, entropy_weights=entropy_weights,
                                    state=self.state, **self.options)

    def reset_state(self):
        """Forget what the backwards taught (UpstreamState.reset)."""
        self.state.reset()

    def extra_repr(self) -> str:
        shown = [f"{k}={v!r}" for k, v in self.options.items() if k != "tp_group"]
        return ", ".join(shown + [f"state={self.state!r}"])
