"""The CCE autograd.Function and the drivers that feed the kernels (or the PyTorch reference).

Per token, with z the (soft-capped) logits over the vocabulary and lse their log-sum-exp:

    loss = lse - (1 - ls) * z[target] - (ls / V) * sum_v z_v + z_loss * lse**2

so that, for upstream gradients g (of loss) and h (of lse),

    d/dz_v = A p_v - B [v == target] - U,   A = g (1 + 2 z_loss lse) + h,  B = g (1 - ls),  U = g ls / V.

The forward computes per-row statistics (max, sum of exp, target logit, sum of logits) and combines
them; the backward recomputes the logits blockwise. Inputs here are already validated, flattened
to [N, D] and stripped of ignored tokens (ops/functional.py does that).
"""

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from cce_parallel.ops import reference


@dataclass(frozen=True)
class ImplTraits:
    """How an impl treats the backward: which gradients are filtered and how sums accumulate.

    accumulate: "dtype" adds tile results straight into the gradient dtype (the paper's CCE),
    "fp32" into fp32 buffers (the compensated modes), "fixed" into int64 fixed point
    (deterministic: integer sums do not depend on the order tiles finish in).
    """

    filter_e: bool
    filter_c: bool
    accumulate: str
    triton: bool = True


IMPL_TRAITS = {
    "cce": ImplTraits(filter_e=True, filter_c=True, accumulate="dtype"),
    "cce_kahan": ImplTraits(filter_e=True, filter_c=True, accumulate="fp32"),
    "cce_kahan_full_c": ImplTraits(filter_e=True, filter_c=False, accumulate="fp32"),
    "cce_kahan_full_e": ImplTraits(filter_e=False, filter_c=True, accumulate="fp32"),
    "exact": ImplTraits(filter_e=False, filter_c=False, accumulate="fixed"),
    "torch": ImplTraits(filter_e=False, filter_c=False, accumulate="fp32", triton=False),
}


@dataclass(frozen=True)
class LossConfig:
    """Non-tensor options of one call, resolved and validated (ops/functional.py builds it).

    filter_eps is None when the impl or the caller turns filtering off. vocab_size is the size of
    the full vocabulary (label smoothing averages over it). use_triton is False for the PyTorch path.
    """

    impl: str
    softcap: Optional[float]
    label_smoothing: float
    z_loss: float
    filter_eps: Optional[float]
    vocab_size: int
    use_triton: bool
    kernel: object = None  # kernels.KernelConfig when use_triton

    @property
    def traits(self) -> ImplTraits:
        return IMPL_TRAITS[self.impl]

    @property
    def filter_e(self) -> bool:
        return self.filter_eps is not None and self.traits.filter_e

    @property
    def filter_c(self) -> bool:
        return self.filter_eps is not None and self.traits.filter_c

    @property
    def sort_vocab(self) -> bool:
        # Sorting only pays when tiles can be skipped.
        return self.use_triton and (self.filter_e or self.filter_c)


# ----------------------------------------------------------------------------------------------
# forward


def combine_splits(mx, se, zt, zsum):
    """Fold [S, N] per-split partials into per-row (max, sumexp, zt, zsum)."""
    m = mx.max(dim=0).values
    safe = torch.where(torch.isfinite(m), m, 0.0)
    se = (se * torch.exp(mx - safe)).sum(dim=0)
    return m, se, zt.sum(dim=0), zsum.sum(dim=0) if zsum is not None else None


def local_stats(e, c, bias, targets, cfg: LossConfig):
    """(max, sumexp, zt, zsum, perm) of each token over the rows of c."""
    need_zsum = cfg.label_smoothing > 0
    if not cfg.use_triton:
        return (*reference.forward_stats(e, c, bias, targets, cfg.softcap, need_zsum=need_zsum), None)
    from cce_parallel import kernels

    mx, se, zt, zsum, colsum = kernels.lse_forward(
        e, c, bias, targets, cfg.softcap, need_zsum=need_zsum, need_colsum=cfg.sort_vocab, config=cfg.kernel
    )
    # Most probable vocabulary rows first, so the tiles that survive filtering are dense.
    perm = torch.argsort(colsum, descending=True) if colsum is not None else None
    return (*combine_splits(mx, se, zt, zsum), perm)


def token_loss(lse, zt, zsum, cfg: LossConfig):
    ls = cfg.label_smoothing
    loss = lse - (1.0 - ls) * zt
    if zsum is not None:
        loss = loss - (ls / cfg.vocab_size) * zsum
    if cfg.z_loss:
        loss = loss + cfg.z_loss * lse * lse
    return loss


# ----------------------------------------------------------------------------------------------
# backward


def coefficients(g_loss, g_lse, lse, cfg: LossConfig):
    """Per-token A, B, U of d loss / d z (see the module docstring); U is None without smoothing."""
    a = g_loss * (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss else g_loss.clone()
    if g_lse is not None:
        a = a + g_lse
    b = g_loss * (1.0 - cfg.label_smoothing)
    u = g_loss * (cfg.label_smoothing / cfg.vocab_size) if cfg.label_smoothing > 0 else None
    return a.contiguous(), b.contiguous(), u


_FIXED_POINT_RANGE = 2.0**61  # headroom of 4x below int64's 2**63 for rounding in the bound
_MIN_BOUND = 2.0**-65  # keeps 2**61 / bound finite in fp32


def _max_abs(x):
    """max |x| as fp32 without an |x|-sized temporary (aminmax reads x once)."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo.float(), hi.float())


def _fixed_point_scales(e, c, a, b, u, vocab):
    """fp32 [3] scales for dE, dC, dbias such that no int64 partial sum can overflow.

    |dE[n, d]| <= max|C| * sum_v |dz[n, v]| <= max|C| * (|A| + |B| + V |U|)   (sum_v p = 1)
    |dC[v, d]| <= max|E| * sum_n (|A| + |B| + |U|)                          (p <= 1)
    Every partial sum of tile contributions obeys the same bound. A non-finite bound (NaN or Inf in
    the inputs) gives a NaN scale, which turns the whole gradient into NaN, as PyTorch would.
    """
    per_tok = a.abs() + b.abs()
    per_tok_e = per_tok + (u.abs() * vocab if u is not None else 0.0)
    per_tok_c = per_tok + (u.abs() if u is not None else 0.0)
    max_c, max_e = _max_abs(c), _max_abs(e)
    bounds = torch.stack(
        [per_tok_e.amax() * max_c, per_tok_c.sum() * max_e, per_tok_c.sum()]
    ).double()
    scales = _FIXED_POINT_RANGE / bounds.clamp_min(_MIN_BOUND)
    return torch.where(torch.isfinite(bounds), scales, float("nan")).float()


def _uniform_outside(e, c, u, de, dc, db):
    """Apply the label-smoothing term -U[n] to every logit gradient with three small products,
    so that filtering (which only looks at p) can skip tiles without dropping it."""
    csum = c.sum(dim=0, dtype=torch.float32)  # [D], no fp32 copy of c
    de.addr_(u.to(de.dtype), csum.to(de.dtype), alpha=-1)
    dc -= (e.t() @ u.to(e.dtype)).to(dc.dtype)[None, :]
    if db is not None:
        db -= u.sum()


def filter_threshold(a, b, lse, zt, eps):
    """Per-row probability threshold: eps * (L1 mass of the row's dz) / |A| (see kernels/backward.py).

    With r = 1 - p[target], sum_v |dz_v| = |(A - B) - A r| + |A| r. r is floored at the fp32
    resolution of lse - z[target]: below that the residual itself is rounding noise.
    """
    r = -torch.expm1(zt - lse)
    r = torch.maximum(r, 2.0**-22 * lse.abs().clamp_min(1.0))
    l1 = ((a - b) - a * r).abs() + a.abs() * r
    return torch.where(a != 0, eps * l1 / a.abs(), float("inf")).float()


def _propagate_nan(lse, de, dc, db):
    """Integers hold no NaN: restore it where PyTorch's gradient would have one.

    A non-finite lse[n] means row n's logit gradient is NaN, which poisons dE[n] and, through the
    sum over tokens, all of dC and dbias. In place, without a host sync.
    """
    bad_rows = ~torch.isfinite(lse)
    de.masked_fill_(bad_rows[:, None], float("nan"))
    any_bad = bad_rows.any()
    dc.masked_fill_(any_bad, float("nan"))
    if db is not None:
        db.masked_fill_(any_bad, float("nan"))


_warned_uniform = False


def triton_backward(e, c, bias, targets, lse, zt, a, b, u, perm, cfg: LossConfig):
    """dE, dC, dbias (input dtype) from the kernels, accumulated as the impl's traits say."""
    global _warned_uniform
    from cce_parallel import kernels

    n, _ = e.shape
    v = c.shape[0]
    if n == 0:  # every token was ignored
        return torch.zeros_like(e), torch.zeros_like(c), torch.zeros_like(bias) if bias is not None else None
    filter_e, filter_c = cfg.filter_e, cfg.filter_c
    uniform_in_kernel = u
    if u is not None and (filter_e or filter_c):
        if cfg.softcap is None:
            uniform_in_kernel = None
        else:
            # With softcap the uniform term is scaled by 1 - tanh^2 per logit: it cannot be
            # factored out, and a filtered tile would drop it. Keep it exact; skip no tile.
            if not _warned_uniform:
                warnings.warn("cce_parallel: label_smoothing with softcap disables gradient filtering")
                _warned_uniform = True
            filter_e = filter_c = False
            perm = None
    acc = cfg.traits.accumulate
    kcfg = cfg.kernel
    thr = filter_threshold(a, b, lse, zt, cfg.filter_eps) if (filter_e or filter_c) else None
    # Centre dE on the mean classifier row when dE is filtered (see kernels/backward.py); the
    # exact mean part, Mu * sum_v dz = Mu * (A - B), is added back here. Softcap scales each dz by
    # its own 1 - tanh^2, so sum_v dx is not known there and the centring is left out.
    mu = c.sum(dim=0, dtype=torch.float32) / v if filter_e and cfg.softcap is None else None
    common = dict(softcap=cfg.softcap, filter_e=filter_e, filter_c=filter_c, config=kcfg)

    if acc == "dtype":
        # dC accumulates straight into the gradient dtype (the paper's CCE). dE goes through an fp32
        # buffer of at most bwd_de_chunk_bytes, one launch per token chunk: a row of dE gathers a term
        # from every kept tile along the vocabulary, and bf16 atomics would round at each of them.
        de = torch.empty_like(e)
        dc = torch.zeros_like(c)
        db = torch.zeros(v, device=c.device, dtype=torch.float32) if bias is not None else None
        rows = kcfg.bwd_de_chunk_bytes // (4 * max(e.shape[1], 1)) // kcfg.bwd_block_n * kcfg.bwd_block_n
        rows = max(kcfg.bwd_block_n, rows)
        de_buf = torch.empty((min(rows, n), e.shape[1]), device=e.device, dtype=torch.float32)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            part = de_buf[: hi - lo]
            part.zero_()
            sl = slice(lo, hi)
            kernels.cce_backward(
                e[sl], c, bias, targets[sl], lse[sl], a[sl], b[sl],
                uniform_in_kernel[sl] if uniform_in_kernel is not None else None,
                thr[sl] if thr is not None else None, perm, mu, part, dc, db, None,
                v_lo=0, v_hi=v, dc_by_position=False, **common,
            )
            if mu is not None:
                part.addr_(a[sl] - b[sl], mu)
            de[sl] = part
        del de_buf
        if u is not None and uniform_in_kernel is None:
            _uniform_outside(e, c, u, de, dc, db)
        return de, dc, db.to(bias.dtype) if db is not None else None

    fixed = acc == "fixed"
    buf_dtype = torch.int64 if fixed else torch.float32
    scales = _fixed_point_scales(e, c, a, b, u, v) if fixed else None
    de_buf = torch.zeros(e.shape, device=e.device, dtype=buf_dtype)
    db_buf = torch.zeros(v, device=c.device, dtype=buf_dtype) if bias is not None else None
    dc = torch.empty_like(c)
    chunk = -(-v // kcfg.bwd_v_chunks)
    chunk = -(-chunk // kcfg.bwd_block_v) * kcfg.bwd_block_v
    dc_buf = None
    for lo in range(0, v, chunk):
        hi = min(v, lo + chunk)
        if dc_buf is None:
            dc_buf = torch.empty((min(chunk, v), c.shape[1]), device=c.device, dtype=buf_dtype)
        part = dc_buf[: hi - lo]
        part.zero_()
        kernels.cce_backward(
            e, c, bias, targets, lse, a, b, uniform_in_kernel, thr, perm, mu, de_buf, part, db_buf, scales,
            v_lo=lo, v_hi=hi, dc_by_position=True, **common,
        )
        val = part.float() * (1.0 / scales[1]) if fixed else part
        if perm is None:
            dc[lo:hi] = val.to(c.dtype)
        else:
            dc[perm[lo:hi]] = val.to(c.dtype)
    del dc_buf
    if fixed:
        de = de_buf.float() * (1.0 / scales[0])
        db = db_buf.float() * (1.0 / scales[2]) if db_buf is not None else None
    else:
        de, db = de_buf, db_buf
    if mu is not None:
        de.addr_(a - b, mu)
    if u is not None and uniform_in_kernel is None:
        _uniform_outside(e, c, u, de, dc, db)
    if fixed:
        _propagate_nan(lse, de, dc, db)
    return de.to(e.dtype), dc, db.to(bias.dtype) if db is not None else None


# ----------------------------------------------------------------------------------------------
# the Function


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(e [N, D], c [V, D], bias [V] | None, targets [N] int64) -> (loss [N] fp32, lse [N] fp32)."""

    @staticmethod
    def forward(ctx, e, c, bias, targets, cfg: LossConfig):
        mx, se, zt, zsum, perm = local_stats(e, c, bias, targets, cfg)
        lse = mx + torch.log(se)
        loss = token_loss(lse, zt, zsum, cfg)
        ctx.cfg = cfg
        ctx.save_for_backward(e, c, bias, targets, lse, zt, perm)
        return loss, lse

    @staticmethod
    def backward(ctx, g_loss, g_lse):
        e, c, bias, targets, lse, zt, perm = ctx.saved_tensors
        cfg: LossConfig = ctx.cfg
        if g_loss is None:
            g_loss = torch.zeros_like(lse)
        a, b, u = coefficients(g_loss.float(), g_lse.float() if g_lse is not None else None, lse, cfg)
        if cfg.use_triton:
            de, dc, db = triton_backward(e, c, bias, targets, lse, zt, a, b, u, perm, cfg)
        else:
            de, dc, db = reference.backward(e, c, bias, targets, lse, a, b, u, cfg.softcap)
        return de, dc, db, None, None
