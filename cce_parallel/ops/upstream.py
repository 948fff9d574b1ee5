"""The upstream gradient: what the backward makes of it, and what a loss learns from it.

The one-pass forward makes the gradients for g = grad_scale * weight on every kept token. Its
backward scales them by the upstream gradient over grad_scale, which is exact when that is one
number over the kept tokens (reduction mean or sum, weights given in the forward, or Megatron's
loss_mask / count with the mask folded into ignore_index, where the ratio is 1 and nothing moves),
except for a bf16 dC or dE, rounded once already: a ratio that is not a power of two has them
recomputed (kernels.snap_ratio decides on the device, kernels.weighted_grads recomputes). An fp32
dE, linear in g per token, scales per row whatever g is.

What a per-token upstream gradient is over the kept tokens is decided on the device, without a
host sync (_weights_over_kept): one number, as above; otherwise kernels.weighted_grads recomputes
dC, dbias and a bf16 dE (exact). Where the forward made fp32 gradients for a mask (LossConfig.fp32_grads),
the backward sorts the weights in one host sync (_weights_kind): for a mask (one number r and 0 on
m tokens) dC and dbias become r (dC - the m rows' part), that part made by one more one-pass sweep of
those m rows alone, so that the cost follows m. That sync waits for the forward to finish; so that
the GPU does not idle while the host then queues the sweep, the sweep of as many masked rows as the
last mask had (UpstreamState.masked_rows) is queued before it, and only the rows past those after.

A call's path follows from its arguments and from the UpstreamState it is given, and from nothing
else. A LinearCrossEntropy module and the Megatron output layer each own one, which learns from
their own backwards: per-token weights that were neither one number nor a mask make that loss's
later reduction="none" calls leave dC to the backward; a mask makes them compute fp32 gradients; a
bf16 dC made for the wrong loss scale teaches the scale. A plain function call passes no state and
learns nothing: each such call takes the path its arguments choose.
"""

import math
import warnings
from collections import Counter
from numbers import Real

import torch


def check_loss_scale(scale, name: str = "loss_scale") -> float:
    """scale as a float; ValueError naming `name` unless it is a finite nonzero real number."""
    if not (isinstance(scale, Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale != 0):
        raise ValueError(f"{name} must be a finite nonzero number, got {scale!r}")
    return float(scale)


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
    """A function that gives (kind, r, m) of the per-token weights w over the kept tokens: ("one",
    r, 0) where they all equal r (0 where all are 0 or nothing is kept); ("mask", r, m) where they
    are 0 on m of them and r on all the others; ("many", None, 0) otherwise, NaN included (it must
    reach the gradients). The numbers are reduced and copied to the host now, without blocking;
    calling the function waits for them alone (an event, one host sync), not for work queued after,
    so the caller can queue work for the GPU before it waits."""
    if not w.numel():
        return lambda: ("one", 0.0, 0)
    inf = float("inf")
    nonzero = keep & (w != 0)  # NaN counts as nonzero: amin / amax propagate it
    packed = torch.stack([torch.where(nonzero, w, inf).amin().double(),
                          torch.where(nonzero, w, -inf).amax().double(),
                          (keep & (w == 0)).sum().double()])
    event = None
    if packed.is_cuda:
        host = torch.empty(3, dtype=torch.float64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        packed = host

    def result():
        if event is not None:
            event.synchronize()
        lo, hi, zeros = packed.tolist()
        if lo == inf:
            return "one", 0.0, 0
        if lo != hi:  # NaN too
            return "many", None, 0
        return ("mask" if zeros else "one"), lo, int(zeros)

    return result


class UpstreamState:
    """What one loss has learned from its own backwards' upstream gradients; its owner (a
    LinearCrossEntropy module, the Megatron output layer) passes it to every call, and `reset()`
    forgets it all. Nothing else in the process reads or writes it.

    per_token_weights_seen: a reduction="none" backward got weights that were neither one number
    nor one number and 0 over the kept tokens: later reduction="none" calls make dE alone (fp32) in
    the forward and dC in one more pass in the backward (LossConfig.defer_dc): four GEMMs instead of
    three plus a recompute.
    masked_weights_seen: such a backward got one number and 0 (Megatron's (loss * loss_mask).sum()
    / count with the mask not folded into ignore_index): later reduction="none" calls make dC and
    dE in fp32, so that the backward takes out the masked rows' part.
    masked_rows: how many kept tokens the last such correction took out. The next backward queues
    its correction on that many masked rows before the host learns their count (the one host sync
    of a mask), so the GPU works while the host waits, and only rows past that many are left for
    after it; 0: nothing is queued ahead.
    loss_scale: the number a bf16 dC and dE are made for when the call gives none: what the reduced
    loss is multiplied by before its backward (1 / micro-batches in Megatron's schedule), learned
    from a backward that brought another (its gradients were recomputed, exact, slow).
    loss_scale_unsteady: the number changed between two backwards in a row (two loss sites with
    different weights): bf16 calls without a given loss_scale take the lean path from then on.
    paths: a Counter of what ran, by name: "one_pass" / "lean" forwards; "scaled" (the forward's
    gradients scaled), "checked" (per-token weights sorted on the device: scaled, or recomputed as
    the report says), "recomputed", "mask_corrected" and "lean" backwards.

    On a GPU the host learns a backward's report one call late (read_reports, after the next
    forward), so that no call waits for it.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        """Forget everything learned: the next call takes the path its arguments choose."""
        self.per_token_weights_seen = False
        self.masked_weights_seen = False
        self.masked_rows = 0
        self.loss_scale = 1.0
        self.loss_scale_unsteady = False
        self.paths = Counter()
        self._last_missed = False  # the last report was a miss (loss_scale is the number it brought)
        # Reports not yet read on the host: (fp32 [2] = (code, ratio), event or None, the loss scale
        # the forward used, whether the caller gave it). code: _ONE, _MANY or _MASK, plus _MISSED
        # where the ratio to that scale was not a power of two (a bf16 dC / dE recomputed).
        self._reports = []

    def __repr__(self):
        learned = [f"loss_scale={self.loss_scale:g}"]
        for name in ("per_token_weights_seen", "masked_weights_seen", "loss_scale_unsteady"):
            if getattr(self, name):
                learned.append(f"{name}=True")
        if self.masked_rows:
            learned.append(f"masked_rows={self.masked_rows}")
        return f"UpstreamState({', '.join(learned)}, paths={dict(self.paths)})"

    def expect_loss_scale(self, scale: float) -> None:
        """Set loss_scale beforehand (and end an unsteady state): the first backward at that scale
        then recomputes nothing. A call's own loss_scale argument takes precedence."""
        self.loss_scale = check_loss_scale(scale, "expect_loss_scale: scale")
        self.loss_scale_unsteady = self._last_missed = False

    def saw_many(self):
        if not self.per_token_weights_seen:
            self.per_token_weights_seen = True
            warnings.warn(
                "cce_parallel: a per-token loss's upstream gradient was neither one number nor one number and 0 "
                "over the kept tokens, so the gradients computed in the forward were recomputed (exact, slower). "
                "This loss's later calls with reduction='none' make dC in their backward; weights known before the "
                "forward (weights=) keep the one-pass speed.",
                stacklevel=4,
            )

    def saw_mask(self):
        self.masked_weights_seen = True

    def _learn_scale(self, value: float):
        """A backward's upstream number was `value` (times the reduction's weights), not loss_scale."""
        from cce_parallel import kernels

        near = kernels.SNAP_ULPS * 2.0**-23 * abs(self.loss_scale)  # as close as snap_ratio's "one number"
        if self._last_missed and abs(value - self.loss_scale) > near and not self.loss_scale_unsteady:
            self.loss_scale_unsteady = True
            warnings.warn(
                f"cce_parallel: the loss's upstream gradient changed between backwards ({self.loss_scale:g}, then "
                f"{value:g}: one loss module used at sites with different weights?). A bf16 dC made in the forward "
                "would be rounded twice, so this loss's calls without an fp32 main_grad take the lean path from now "
                "on (exact, slower). A loss_scale argument per call (or a module per site) keeps the one-pass speed.",
                stacklevel=5,
            )
        self.loss_scale, self._last_missed = value, True

    def report(self, packed: torch.Tensor, used: float, given: bool):
        """Queue a backward's report (fp32 [2] = code, ratio; kernels.snap_ratio): read at once on
        a CPU; on a GPU through a pinned copy that the next call reads after its forward. used: the
        loss scale the forward made the gradients for; given: the caller passed it (the report then
        teaches loss_scale nothing). Every tensor-parallel rank gets the same upstream gradient, so
        all ranks' states learn the same at the same call."""
        if packed.is_cuda:
            host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._reports.append((host, event, used, given))
        else:
            self._reports.append((packed, None, used, given))
            self.read_reports()

    def read_reports(self):
        """What earlier backwards reported, in their order. ops/functional.py calls this after a
        call's forward has waited for its targets' counts, which the stream orders after the
        earlier backwards' reports: so it never waits on the GPU."""
        while self._reports:
            host, event, used, given = self._reports.pop(0)
            if event is not None:
                event.synchronize()
            code, ratio = host.tolist()
            kind, missed = int(code) % _MISSED, code >= _MISSED
            if kind == _MANY:
                self.saw_many()
            elif kind == _MASK:
                self.saw_mask()
            if kind != _ONE or missed:
                self.paths["recomputed"] += 1
            if given:  # the caller's number stays theirs; loss_scale learns nothing from it
                if missed:
                    warnings.warn(
                        f"cce_parallel: the loss's upstream gradient was {ratio * used:g} (times the reduction's "
                        f"weights), not the loss_scale={used:g} it was given, so its bf16 gradients were "
                        "recomputed (exact, slower). Pass the number the loss is multiplied by before its backward.",
                        stacklevel=3,
                    )
            elif missed:
                self._learn_scale(ratio * used)
            else:
                self._last_missed = False
