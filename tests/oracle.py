"""Independent references for the linear + cross-entropy loss (no cce_parallel import).

- ``oracle``: dense float64 autograd written from the math in ops/common.py's docstring, chunked over tokens
  when asked so that it fits in GPU memory at real vocabulary sizes. This is the ground truth.
- ``plain_torch``: what a PyTorch user writes in the input dtype (``F.linear`` in bf16/fp16,
  ``.float()``, softcap, ``F.cross_entropy``). Its error against the oracle is the error bar for
  the low-precision tests: the kernels must do no worse, plus a small epsilon.
- ``rel_err``: relative Frobenius error, computed in float64.

Per token n with target t and logits x = e @ c.T + bias, divided by the temperature T (1 unless given):
    z = softcap * tanh(x / T / softcap)  (or z = x / T)
    lse = logsumexp(z)
    loss = lse - (1 - ls) * z_t - (ls / V) * sum_v z_v + z_loss * lse**2, and 0 where ignored.
Reduction "mean" divides the sum by the number of non-ignored tokens (NaN when there are none).
With per-token weights w (the loss's `weights`), each token's loss is w * loss and "mean" divides
the sum by the sum of w over the non-ignored tokens.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Outputs(NamedTuple):
    """Loss (reduced as asked), lse (shaped like targets; None if not asked) and input gradients."""

    loss: torch.Tensor
    lse: torch.Tensor | None
    de: torch.Tensor
    dc: torch.Tensor
    dbias: torch.Tensor | None


def _options(ignore_index=-100, softcap=None, label_smoothing=0.0, z_loss=0.0, reduction="mean", temperature=1.0,
             **_ignored):
    # Keyword options of linear_cross_entropy that the references do not use (impl, logits_budget,
    # return_lse) are dropped here, so callers can pass one options dict to both sides.
    return ignore_index, softcap, label_smoothing, z_loss, reduction, temperature


def _upstream_weights(grad_loss, reduction, n_tokens, n_valid, device):
    """d(reduced loss)/d(per-token loss) times the upstream gradient, per token, in float64
    (n_valid: the mean's divisor)."""
    if grad_loss is None:
        grad_loss = torch.ones((), dtype=torch.float64, device=device) if reduction != "none" else None
    if reduction == "none":
        if grad_loss is None:
            return torch.ones(n_tokens, dtype=torch.float64, device=device)
        return grad_loss.detach().reshape(-1).to(torch.float64)
    g = grad_loss.detach().to(torch.float64).reshape(()).expand(n_tokens)
    if reduction == "mean":
        # torch.nn.functional.cross_entropy gives zero gradients when every token is ignored.
        g = g / n_valid if n_valid != 0 else torch.zeros_like(g)
    return g


def _reduce(loss_tok, reduction, shape, n_valid):
    if reduction == "none":
        return loss_tok.reshape(shape)
    total = loss_tok.sum()
    return total if reduction == "sum" else total / n_valid  # 0 / 0 is NaN, as in F.cross_entropy


def oracle(e, c, targets, bias=None, *, grad_loss=None, grad_lse=None, chunk_size=None, weights=None,
           **options) -> Outputs:
    """Float64 reference of loss, lse and the gradients for the given upstream gradients.

    grad_loss: upstream gradient of the loss (shaped like the loss; default 1).
    weights: per-token weights (shaped like targets) or None; see the module docstring.
    grad_lse: upstream gradient of lse (shaped like targets), or None when lse is not used.
    chunk_size: tokens per chunk (None: all at once). Results do not depend on it.
    Returns float64 tensors; lse is returned in any case (0 where ignored).
    """
    ignore_index, softcap, ls, z_loss, reduction, temperature = _options(**options)
    f64 = torch.float64
    dim = e.shape[-1]
    vocab = c.shape[0]
    e2 = e.detach().reshape(-1, dim)
    t2 = targets.detach().reshape(-1).long()
    n_tokens = t2.shape[0]
    valid = t2 != ignore_index
    n_valid = int(valid.sum())
    w_tok = None if weights is None else weights.detach().reshape(-1).to(f64)
    divisor = n_valid if w_tok is None else float(w_tok[valid].sum())
    weights = _upstream_weights(grad_loss, reduction, n_tokens, divisor, e.device)
    if w_tok is not None:
        weights = weights * w_tok
    g_lse = None if grad_lse is None else grad_lse.detach().reshape(-1).to(f64)

    c64 = c.detach().to(f64).requires_grad_()
    b64 = None if bias is None else bias.detach().to(f64).requires_grad_()
    leaves_shared = [c64] + ([b64] if b64 is not None else [])
    dc = torch.zeros_like(c64)
    db = None if b64 is None else torch.zeros_like(b64)
    losses, lses, des = [], [], []
    step = n_tokens if chunk_size is None else chunk_size
    for start in range(0, max(n_tokens, 1), max(step, 1)):
        sl = slice(start, start + step)
        e64 = e2[sl].to(f64).requires_grad_()
        t, ok = t2[sl], valid[sl]
        with torch.enable_grad():
            x = e64 @ c64.T
            if b64 is not None:
                x = x + b64
            x = x / temperature
            z = softcap * torch.tanh(x / softcap) if softcap is not None else x
            lse = torch.logsumexp(z, dim=-1)
            z_t = z.gather(1, torch.where(ok, t, 0).unsqueeze(1)).squeeze(1)
            loss = lse - (1.0 - ls) * z_t - (ls / vocab) * z.sum(-1) + z_loss * lse * lse
            loss = torch.where(ok, loss, torch.zeros_like(loss))
            lse = torch.where(ok, lse, torch.zeros_like(lse))
            objective = (loss * weights[sl]).sum()
            if g_lse is not None:
                objective = objective + (lse * g_lse[sl]).sum()
            grads = torch.autograd.grad(objective, [e64] + leaves_shared)
        losses.append(loss.detach())
        lses.append(lse.detach())
        des.append(grads[0])
        dc += grads[1]
        if db is not None:
            db += grads[2]
    loss_tok = torch.cat(losses)[:n_tokens]
    if w_tok is not None:
        loss_tok = loss_tok * w_tok
    return Outputs(
        loss=_reduce(loss_tok, reduction, targets.shape, divisor),
        lse=torch.cat(lses)[:n_tokens].reshape(targets.shape),
        de=torch.cat(des)[:n_tokens].reshape(e.shape),
        dc=dc,
        dbias=db,
    )


def plain_torch(e, c, targets, bias=None, *, grad_loss=None, grad_lse=None, weights=None, **options) -> Outputs:
    """The loss as a PyTorch user computes it: logits in the input dtype, then fp32 cross-entropy.

    Gradients come back in the input dtype, as autograd gives them. Not chunked: the logits are
    materialized (that is the point of the comparison).
    """
    ignore_index, softcap, ls, z_loss, reduction, temperature = _options(**options)
    dim = e.shape[-1]
    e_ = e.detach().reshape(-1, dim).requires_grad_()
    c_ = c.detach().requires_grad_()
    b_ = None if bias is None else bias.detach().requires_grad_()
    t = targets.detach().reshape(-1).long()
    valid = t != ignore_index
    n_valid = int(valid.sum())
    with torch.enable_grad():
        logits = F.linear(e_, c_, b_)
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        lse = torch.logsumexp(z, dim=-1)
        loss = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=ls, reduction="none")
        if z_loss:
            loss = loss + z_loss * torch.where(valid, lse * lse, torch.zeros_like(lse))
        lse = torch.where(valid, lse, torch.zeros_like(lse))
        if weights is not None:
            w = torch.where(valid, weights.reshape(-1).float(), 0.0)
            loss, n_valid = loss * w, w.sum()
        loss = _reduce(loss, reduction, targets.shape, n_valid)
        outs, upstream = [loss], [torch.ones_like(loss) if grad_loss is None else grad_loss.to(loss.dtype)]
        if grad_lse is not None:
            outs.append(lse)
            upstream.append(grad_lse.reshape(-1).to(lse.dtype))
        leaves = [e_, c_] + ([b_] if b_ is not None else [])
        grads = torch.autograd.grad(outs, leaves, upstream)
    return Outputs(
        loss=loss.detach(),
        lse=lse.detach().reshape(targets.shape),
        de=grads[0].reshape(e.shape),
        dc=grads[1],
        dbias=grads[2] if b_ is not None else None,
    )


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (Frobenius, float64); ||x|| when ref is all zeros.

    Positions where ref is NaN must be NaN in x too (else the error is inf) and are left out.
    Any other non-finite value in x gives inf.
    """
    x = x.detach().to(device=ref.device, dtype=torch.float64)
    ref = ref.detach().to(torch.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}")
    nan_ref = torch.isnan(ref)
    if bool((nan_ref & ~torch.isnan(x)).any()):
        return math.inf
    x, ref = x[~nan_ref], ref[~nan_ref]
    if not bool(torch.isfinite(x).all()):
        return math.inf
    ref_norm = float(torch.linalg.vector_norm(ref))
    diff_norm = float(torch.linalg.vector_norm(x - ref))
    return diff_norm / ref_norm if ref_norm > 0 else diff_norm
