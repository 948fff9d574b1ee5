"""The upstream gradient: what the backward makes of it, and what the host learns from it.

The one-pass forward makes the gradients for g = grad_scale on every kept token. Its backward
scales them by the upstream gradient over that, which is exact when g is one number over the kept
tokens (reduction mean or sum, or Megatron's loss_mask / count with the mask folded into
ignore_index, where the ratio is 1 and nothing moves), except for a bf16 dC or dE, rounded once
already: a ratio that is not a power of two has them recomputed (kernels.snap_ratio decides on the
device, kernels.weighted_grads recomputes), and the forwards after make them for that number
(loss_scale below). An fp32 dE, linear in g per token, scales per row whatever g is.

What a per-token g is over the kept tokens is decided on the device, without a host sync
(_weights_over_kept): one number, as above; otherwise kernels.weighted_grads recomputes dC, dbias
and a bf16 dE (exact), and the host learns the kind (a call later, on a GPU). Any weights but a
mask: later per-token calls take the lean path. One number r and 0 on m tokens (Megatron's
loss_mask / count with the mask not folded): later per-token calls make dC and dE in fp32
(masked_weights_seen). Once the host knows of a mask, the backward of a forward that made fp32
gradients sorts its weights in one host sync (_weights_kind); for a mask dC and dbias become
r (dC - the m rows' part), that part recomputed by the lean backward on those m rows alone, so that
the cost follows m.
"""

import math
import warnings
from numbers import Real

import torch

# What the host has learned of earlier backwards' upstream gradients:
#
# per_token_weights_seen: a per-token loss's backward got weights that were neither one number nor
# one number and 0 over the kept tokens (_MANY). From then on, reduction "none" takes the lean path
# (ops/functional.py), which computes them with no wasted work.
# masked_weights_seen: a per-token loss's backward got one number and 0 over the kept tokens (_MASK:
# Megatron's (loss * loss_mask).sum() / count with the mask not folded into ignore_index). From then
# on, reduction "none" makes dC and dE in fp32 in the forward (LossConfig.fp32_grads) and sorts the
# weights in the backward on the host, so that a mask's backward subtracts the masked rows' part.
# Both are learned from the device's report (read_backward_reports): training loops call the loss
# the same way every step, so only the first call (on a GPU the first two) recomputes all.
#
# loss_scale: the default of the loss's loss_scale argument (ops/functional.py), for calls that pass
# none: the number the one-pass forward makes a bf16 dC and dE for (no fp32 main_grad), times
# the reduction's own weights: what the caller multiplies the reduced loss by before the backward
# (1 / micro-batches in Megatron's schedule). The backward scales the stored gradients by the
# upstream gradient over that; a bf16 gradient scaled by a number that is not a power of two would
# be rounded a second time (worse than plain bf16 PyTorch), so there kernels.weighted_grads
# recomputes it (exact, slow) and the host learns the number for later calls (read_backward_reports:
# on a GPU from the second call after). expect_loss_scale sets it beforehand.
# loss_scale_unsteady: the number changed between two backwards in a row (loss sites with different
# weights, say): bf16-dC calls take the lean path from then on, exact for any upstream gradient.
# A call given loss_scale uses that number as it is: the one-pass path, whatever these two say, and
# its backward's report teaches them nothing (a number that disagrees is recomputed, with a warning).
per_token_weights_seen = False
masked_weights_seen = False
loss_scale = 1.0
loss_scale_unsteady = False
_last_missed = False  # the last report was a miss (loss_scale is the number it brought)

# Reports of backwards on a GPU not yet read on the host: (pinned fp32 [2] = (code, ratio), event,
# the loss_scale its forward used, whether the caller gave it). code: the per-token weights' kind
# (_ONE, _MANY, _MASK), plus _MISSED where the number's ratio to loss_scale is not a power of two (a
# bf16 dC / dE recomputed).
_reports: list = []


def check_loss_scale(scale, name: str = "loss_scale") -> float:
    """scale as a float; ValueError naming `name` unless it is a finite nonzero real number."""
    if not (isinstance(scale, Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale != 0):
        raise ValueError(f"{name} must be a finite nonzero number, got {scale!r}")
    return float(scale)


def expect_loss_scale(scale: float) -> None:
    """Set the process-wide default of the loss's loss_scale argument: what the reduced loss will
    be multiplied by before its backward (for example 1 / micro-batches where the loss is divided
    by their number), so that a bf16 dC computed in the forward is made for it: rounded once, with
    no recompute at the first backward. Calls that pass loss_scale use theirs instead (the
    documented way); without either the loss learns the number from its backwards. It also ends an
    "unsteady" state (changing numbers sent bf16 calls down the lean path): the one-pass path is
    taken again, until two different numbers in a row are seen again."""
    global loss_scale, loss_scale_unsteady, _last_missed
    loss_scale = check_loss_scale(scale, "expect_loss_scale: scale")
    loss_scale_unsteady, _last_missed = False, False


def _warn_many():
    global per_token_weights_seen
    if not per_token_weights_seen:
        per_token_weights_seen = True
        warnings.warn(
            "cce_parallel: a per-token loss's upstream gradient was neither one number nor one number and 0 over "
            "the kept tokens, so the gradients computed in the forward could not just be scaled; they were "
            "recomputed (exact, slower). Later calls with reduction='none' in this process take the lean path "
            "(logits_budget='lean').",
            stacklevel=3,
        )


def _learn_scale(value: float):
    """A backward's upstream number was `value` (times the reduction's weights), not loss_scale."""
    from cce_parallel import kernels

    global loss_scale, loss_scale_unsteady, _last_missed
    near = kernels.SNAP_ULPS * 2.0**-23 * abs(loss_scale)  # two numbers this close are one, as in snap_ratio
    if _last_missed and abs(value - loss_scale) > near and not loss_scale_unsteady:
        loss_scale_unsteady = True
        warnings.warn(
            f"cce_parallel: the loss's upstream gradient changed between backwards ({loss_scale:g}, then "
            f"{value:g}: loss sites with different weights?). A bf16 dC made in the forward would be rounded twice, "
            "so calls without an fp32 main_grad take the lean path from now on (exact, slower). Each call's own "
            "loss_scale argument (or one per process: cce_parallel.expect_loss_scale) keeps the one-pass speed.",
            stacklevel=4,
        )
    loss_scale, _last_missed = value, True


_ONE, _MANY, _MASK = 0, 1, 2  # the per-token weights' kinds, as the device reports them
_MISSED = 4  # added to the report's code: a loss scale whose ratio is not a power of two


def _weights_over_kept(w: torch.Tensor, keep: torch.Tensor):
    """(ratio, kind) of the per-token weights w over the kept tokens, on the device: kind int32 [1]
    _ONE where they are one number (ratio, 0-dim fp32, that number; 0 where all are 0 or nothing is
    kept), _MASK where they are 0 on some and one number on the others, _MANY otherwise (NaN
    included); ratio 0 unless _ONE. No host sync: Megatron's (loss * mask).sum() / count with the
    mask folded into ignore_index takes this path on every call, and a sync there leaves the GPU
    idle until the host queues its next work."""
    if not w.numel():  # no tokens: zero gradients
        return w.new_zeros(()), torch.zeros(1, device=w.device, dtype=torch.int32)
    inf = float("inf")
    nonzero = keep & (w != 0)  # NaN counts as nonzero: amin / amax propagate it
    lo, hi = torch.where(nonzero, w, inf).amin(), torch.where(nonzero, w, -inf).amax()
    zeros = (keep & (w == 0)).any()
    none = lo == inf
    same = lo >= hi  # False where NaN
    kind = torch.where(none | (same & ~zeros), _ONE, torch.where(same, _MASK, _MANY))
    ratio = torch.where(none | (kind != _ONE), 0.0, lo)
    return ratio, kind.to(torch.int32).reshape(1)


def _weights_kind(w: torch.Tensor, keep: torch.Tensor):
    """(kind, r) of the per-token weights w over the kept tokens, in one host sync: ("one", r) where
    they all equal r (0 where all are 0 or nothing is kept); ("mask", r) where they are 0 on some
    and r on all the others; ("many", None) otherwise, NaN included (it must reach the gradients)."""
    if not w.numel():
        return "one", 0.0
    inf = float("inf")
    nonzero = keep & (w != 0)  # NaN counts as nonzero: amin / amax propagate it
    lo, hi, zeros = torch.stack([torch.where(nonzero, w, inf).amin().double(),
                                 torch.where(nonzero, w, -inf).amax().double(),
                                 (keep & (w == 0)).sum().double()]).tolist()
    if lo == inf:
        return "one", 0.0
    if lo != hi:  # NaN too
        return "many", None
    return ("mask" if zeros else "one"), lo


def _saw_masked():
    global masked_weights_seen
    masked_weights_seen = True


def _report(packed: torch.Tensor, used: float, given: bool):
    """Send a backward's report (fp32 [2] = code, ratio; kernels.snap_ratio) to the host: at once on
    a CPU; on a GPU through a pinned copy that the next call of the loss reads after its forward
    (read_backward_reports). used: the loss scale its forward made the gradients for; given: the
    caller passed it (then the report teaches the default nothing). Every tensor-parallel rank gets
    the same upstream gradient, so they all learn the same at the same call."""
    if packed.is_cuda:
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        _reports.append((host, event, used, given))
    else:
        _reports.append((packed, None, used, given))
        read_backward_reports()


def read_backward_reports():
    """What earlier backwards reported (_report), in their order; ops/functional.py calls this
    after each call's forward has waited for its targets' counts, which the stream orders after
    the earlier backwards' reports: on a GPU the host learns a backward's report one call late."""
    global _last_missed
    while _reports:
        host, event, used, given = _reports.pop(0)
        if event is not None:
            event.synchronize()
        code, ratio = host.tolist()
        kind, missed = int(code) % _MISSED, code >= _MISSED
        if kind == _MANY:
            _warn_many()
        elif kind == _MASK:
            _saw_masked()
        if given:  # the caller's number stays theirs; the default learns nothing from it
            if missed:
                warnings.warn(
                    f"cce_parallel: the loss's upstream gradient was {ratio * used:g} (times the reduction's "
                    f"weights), not the loss_scale={used:g} it was given, so its bf16 gradients were "
                    "recomputed (exact, slower). Pass the number the loss is multiplied by before its backward.",
                    stacklevel=3,
                )
        elif missed:
            _learn_scale(ratio * used)
        else:
            _last_missed = False
