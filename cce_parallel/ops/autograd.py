"""The CCE autograd.Function and the drivers that feed the kernels (or the PyTorch reference).

Per token, with z the (soft-capped) logits over the vocabulary and lse their log-sum-exp:

    loss = lse - (1 - ls) * z[target] - (ls / V) * sum_v z_v + z_loss * lse**2

so that, for upstream gradients g (of loss) and h (of lse),

    d/dz_v = A p_v - B [v == target] - U,   A = g (1 + 2 z_loss lse) + h,  B = g (1 - ls),  U = g ls / V.

The forward computes per-row statistics (max, sum of exp, target logit, sum of logits) over the
local vocabulary and combines them (across tensor-parallel ranks through `Collectives`); the
backward recomputes the logits blockwise. Inputs here are already validated and flattened to [N, D]
(ops/functional.py does that); ignored tokens are dropped inside the Function, before any kernel.

Under tensor parallelism each rank holds a shard of the vocabulary. Per token, the ranks combine
their max with one all-reduce (MAX) and their rescaled sums, target logits and logit sums with one
more (SUM). In the backward each rank's dE is a partial sum, reduced in fp32 (int64 for "exact"),
and dC / dbias stay local. This module never imports torch.distributed: parallel/ passes in the
collectives.
"""

import functools
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
    def dense_backward(self) -> bool:
        """The workspace backward with dense library GEMMs (the default on the Triton path): skipping
        a tile saves nothing there, so nothing is filtered."""
        k = self.kernel
        return self.use_triton and k is not None and k.bwd_workspace_bytes > 0 and k.bwd_dense_gemm > 0

    @property
    def filter_e(self) -> bool:
        return self.filter_eps is not None and self.traits.filter_e and not self.dense_backward

    @property
    def filter_c(self) -> bool:
        return self.filter_eps is not None and self.traits.filter_c and not self.dense_backward

    @property
    def sort_vocab(self) -> bool:
        # Sorting only pays when tiles can be skipped.
        return self.use_triton and (self.filter_e or self.filter_c)


# ----------------------------------------------------------------------------------------------
# collectives


class Collectives:
    """Collectives over the ranks that share one vocabulary. This default is a single process that
    owns all of it; parallel/collectives.py supplies the process-group version.

    `first` marks the one rank that adds the terms which must appear once in a sum over ranks.
    """

    first = True

    def all_max_(self, t):
        return t

    def all_sum_(self, t):
        return t

    def gather_rows(self, x):
        """Concatenate every rank's rows (sequence parallelism's all-gather along dim 0)."""
        return x

    def sum_scatter_rows(self, x):
        """Sum over ranks, keep this rank's block of rows (the reduce-scatter along dim 0)."""
        return x


SINGLE = Collectives()


# ----------------------------------------------------------------------------------------------
# forward


def local_stats(e, c, bias, targets, cfg: LossConfig):
    """(max, sumexp, zt, zsum, perm) of each token over the rows of c (this rank's shard)."""
    need_zsum = cfg.label_smoothing > 0
    if not cfg.use_triton:
        return (*reference.forward_stats(e, c, bias, targets, cfg.softcap, need_zsum=need_zsum), None)
    from cce_parallel import kernels

    if cfg.kernel.fwd_dense_gemm and not cfg.sort_vocab:
        return (*_combine(*_dense_stats(e, c, bias, targets, need_zsum, cfg), SINGLE, dim=0), None)
    mx, se, zt, zsum, colsum = kernels.lse_forward(
        e, c, bias, targets, cfg.softcap, need_zsum=need_zsum, need_colsum=cfg.sort_vocab, config=cfg.kernel
    )
    # Most probable vocabulary rows first, so the tiles that survive filtering are dense.
    perm = torch.argsort(colsum, descending=True, stable=True) if colsum is not None else None
    return (*_combine(mx, se, zt, zsum, SINGLE, dim=0), perm)


def logit_chunk(n: int, v: int, budget: int, bytes_per_logit: int, block_v: int) -> int:
    """Vocabulary columns per chunk: a multiple of block_v whose n x chunk logits fit the budget
    (at least block_v, at most v rounded up)."""
    vc = max(block_v, budget // (max(n, 1) * bytes_per_logit) // block_v * block_v)
    return min(vc, -(-v // block_v) * block_v)


def dense_blocks(n: int, v: int, budget: int, bytes_per_logit: int, block_v: int, min_cols: int):
    """(token rows, vocabulary columns) of one dense-path chunk within `budget` bytes.

    All n tokens go in one block while that leaves at least min_cols columns per chunk; past that
    the tokens are split into equal blocks. Otherwise the chunks would narrow as 1/n, and every
    chunk re-reads e and re-writes the fp32 dE: traffic quadratic in n (at 65,536 tokens of
    Gemma 2 2B that made forward+backward 20x, not 8x, the time of 8,192).
    """
    n = max(n, 1)
    full_v = -(-v // block_v) * block_v
    cols = min(max(min_cols, block_v), full_v)
    most = max(1, budget // (cols * bytes_per_logit))
    rows = -(-n // -(-n // most))  # equal blocks of at most `most` rows
    return rows, logit_chunk(rows, v, budget, bytes_per_logit, block_v)


def logits_into(out, e, c_rows):
    """out [N, rows] fp32 = e @ c_rows^T, accumulated in fp32 by the library GEMM."""
    if e.dtype == torch.float32:
        torch.mm(e, c_rows.t(), out=out)
    else:
        torch.mm(e, c_rows.t(), out_dtype=torch.float32, out=out)


class _Partials:
    """The forward's [S, N] partial statistics, one row per (vocabulary chunk, column slice).

    At most `rows` rows are kept: when the next chunk would not fit, the rows so far are folded into
    the first one (as _combine does at the end), so that S does not grow with V / chunk."""

    def __init__(self, rows: int, n: int, need_zsum: bool, device):
        f32 = dict(device=device, dtype=torch.float32)
        # Every launched slice writes all its rows (an empty slice writes max -inf, sums 0).
        self.mx = torch.full((rows, n), float("-inf"), **f32)
        self.se, self.zt = torch.zeros((rows, n), **f32), torch.zeros((rows, n), **f32)
        self.zsum = torch.zeros((rows, n), **f32) if need_zsum else None
        self.used = 0

    def reserve(self, k: int) -> int:
        """The first of k free rows."""
        if self.used + k > self.mx.shape[0]:
            mx = self.rows()[0]
            m = mx.max(dim=0).values  # the true max: _combine's is 0 where it is not finite
            _, self.se[0], self.zt[0], zsum = _combine(*self.rows(), SINGLE, dim=0)
            self.mx[0] = m
            if zsum is not None:
                self.zsum[0] = zsum
            self.used = 1
        first, self.used = self.used, self.used + k
        return first

    def rows(self):
        u = max(self.used, 1)
        return self.mx[:u], self.se[:u], self.zt[:u], self.zsum[:u] if self.zsum is not None else None


def _dense_stats(e, c, bias, targets, need_zsum, cfg):
    """The forward's [S, N] partials from fp32 logit chunks (kernels/from_logits.py): vocabulary
    chunks, each over blocks of tokens (see dense_blocks)."""
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, v = e.shape[0], c.shape[0]
    nt, vc = dense_blocks(n, v, kcfg.fwd_chunk_bytes, 4, kcfg.fwd_block_v, kcfg.dense_min_cols)
    slices = kernels.stats_slices(nt, vc, kcfg, e.is_cuda)
    # Room for a quarter of the chunk budget, and at least two chunks' rows.
    cap = max(2 * slices, min(max(1, -(-v // vc)) * slices, kcfg.fwd_chunk_bytes // 4 // (16 * max(n, 1))))
    part = _Partials(cap, n, need_zsum, e.device)
    if n == 0 or v == 0:
        return part.rows()
    x = torch.empty((nt, vc), device=e.device, dtype=torch.float32)
    for lo in range(0, v, vc):
        hi = min(v, lo + vc)
        split = part.reserve(slices)
        for t0 in range(0, n, nt):
            t1 = min(n, t0 + nt)
            xs = x[: t1 - t0, : hi - lo]
            logits_into(xs, e[t0:t1], c[lo:hi])
            cols = slice(t0, t1)
            kernels.stats_from_logits(
                xs, bias, targets[cols], cfg.softcap, part.mx[:, cols], part.se[:, cols], part.zt[:, cols],
                part.zsum[:, cols] if need_zsum else None, split=split, slices=slices, v_lo=lo, v_hi=hi,
                config=kcfg,
            )
    return part.rows()


def _combine(mx, se, zt, zsum, comm, dim=None):
    """Fold partial statistics: the kernel's [S, N] splits (dim=0), or ranks' [N] rows (comm).

    Returns (max, sumexp relative to that max, zt, zsum). One MAX and one SUM all-reduce for ranks.
    """
    m = mx.max(dim=0).values if dim is not None else comm.all_max_(mx.clone())
    safe = torch.where(torch.isfinite(m), m, 0.0)
    scaled = se * torch.exp(mx - safe)
    if dim is not None:
        return safe, scaled.sum(dim=0), zt.sum(dim=0), zsum.sum(dim=0) if zsum is not None else None
    packed = torch.stack([scaled, zt] + ([zsum] if zsum is not None else []))
    comm.all_sum_(packed)
    return safe, packed[0], packed[1], packed[2] if zsum is not None else None


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


def _fixed_point_scales(e, c, a, b, u, vocab, comm):
    """fp32 [3] scales for dE, dC, dbias such that no int64 partial sum can overflow.

    |dE[n, d]| <= max|C| * sum_v |dz[n, v]| <= max|C| * (|A| + |B| + V |U|)   (sum_v p = 1)
    |dC[v, d]| <= max|E| * sum_n (|A| + |B| + |U|)                          (p <= 1)
    Every partial sum of tile contributions, and every rank's share, obeys the same bound. The
    bounds are maxed over ranks, so all ranks use one scale and their int64 dE can be summed
    exactly. A non-finite bound (NaN or Inf in the inputs) gives a NaN scale.
    """
    per_tok = a.abs() + b.abs()
    per_tok_e = per_tok + (u.abs() * vocab if u is not None else 0.0)
    per_tok_c = per_tok + (u.abs() if u is not None else 0.0)
    bounds = torch.stack([per_tok_e.amax() * _max_abs(c), per_tok_c.sum() * _max_abs(e), per_tok_c.sum()])
    comm.all_max_(bounds)
    bounds = bounds.double()
    scales = _FIXED_POINT_RANGE / bounds.clamp_min(_MIN_BOUND)
    return torch.where(torch.isfinite(bounds), scales, float("nan")).float()


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


class _DeFinisher:
    """Turns fp32 partial dE rows (this rank's vocabulary only) into what the caller wants.

    reduce=True sums them over ranks (in place, in fp32) and every rank adds the once-only mean
    term; reduce=False leaves a partial sum (sequence parallelism reduce-scatters it later) and only
    the first rank adds that term. The local label-smoothing part, -U * sum_{v in shard} C[v], is a
    partial sum like the rest and is added before the reduction.
    """

    def __init__(self, comm, reduce, a, b, u_outside, csum_local, mu):
        self.comm, self.reduce = comm, reduce
        self.a, self.b, self.u, self.csum, self.mu = a, b, u_outside, csum_local, mu

    def __call__(self, part, rows):
        if self.u is not None:
            part.addr_(self.u[rows], self.csum, alpha=-1)
        if self.reduce:
            self.comm.all_sum_(part)
        if self.mu is not None and (self.reduce or self.comm.first):
            part.addr_(self.a[rows] - self.b[rows], self.mu)
        return part


_warned_uniform = False


def triton_backward(e, c, bias, targets, lse, zt, a, b, u, perm, cfg: LossConfig, comm=SINGLE, reduce_de=True):
    """(dE, dC, dbias) from the kernels, accumulated as the impl's traits say.

    dE is the full gradient in the input dtype when reduce_de, else this rank's fp32 partial sum.
    """
    global _warned_uniform
    from cce_parallel import kernels

    n, _ = e.shape
    v = c.shape[0]
    de_dtype = e.dtype if reduce_de else torch.float32
    if n == 0:  # every token was ignored
        db = torch.zeros_like(bias) if bias is not None else None
        return torch.zeros(e.shape, device=e.device, dtype=de_dtype), torch.zeros_like(c), db
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
    u_outside = u if uniform_in_kernel is None else None
    acc = cfg.traits.accumulate
    kcfg = cfg.kernel
    thr = filter_threshold(a, b, lse, zt, cfg.filter_eps) if (filter_e or filter_c) else None
    csum = c.sum(dim=0, dtype=torch.float32) if (filter_e and cfg.softcap is None) or u_outside is not None else None
    # Centre dE on the mean classifier row (over the full vocabulary) when dE is filtered (see
    # kernels/backward.py); the exact mean part, Mu * sum_v dz = Mu * (A - B), is added back once.
    # Softcap scales each dz by its own 1 - tanh^2, so sum_v dx is not known there: no centring.
    mu = None
    if filter_e and cfg.softcap is None:
        mu = comm.all_sum_(csum.clone()) / cfg.vocab_size
    finish = _DeFinisher(comm, reduce_de, a, b, u_outside, csum, mu)
    common = dict(softcap=cfg.softcap, filter_e=filter_e, filter_c=filter_c, config=kcfg)

    if cfg.dense_backward:
        # The default: library GEMMs, nothing filtered, nothing atomic (benchmarks/results/NOTES.md).
        de, dc, db = _dense_backward(e, c, bias, targets, lse, a, b, uniform_in_kernel, cfg, finish)
        de = de.to(de_dtype)
    elif kcfg.bwd_workspace_bytes:
        # The block-sparse workspace backward: on an H200 it was 3x (cce) to 18x ("exact") faster
        # than the tile-wise paths below, and deterministic for every impl, as nothing in it is
        # atomic. dC is summed in fp32 registers and rounded once.
        de, dc, db = _workspace_backward(
            e, c, bias, targets, lse, a, b, uniform_in_kernel, thr, perm, mu, filter_e, filter_c, cfg, finish
        )
        de = de.to(de_dtype)
    elif acc == "dtype":
        # dC accumulates straight into the gradient dtype (the paper's CCE). dE goes through an fp32
        # buffer of at most bwd_de_chunk_bytes, one launch per token chunk: a row of dE gathers a
        # term from every kept tile along the vocabulary, and bf16 atomics would round at each.
        db = torch.zeros(v, device=c.device, dtype=torch.float32) if bias is not None else None
        de = torch.empty(e.shape, device=e.device, dtype=de_dtype)
        dc = torch.zeros_like(c)
        rows = kcfg.bwd_de_chunk_bytes // (4 * max(e.shape[1], 1)) // kcfg.bwd_block_n * kcfg.bwd_block_n
        rows = max(kcfg.bwd_block_n, rows)
        de_buf = torch.empty((min(rows, n), e.shape[1]), device=e.device, dtype=torch.float32) if reduce_de else None
        for lo in range(0, n, rows):
            sl = slice(lo, min(n, lo + rows))
            part = de_buf[: sl.stop - lo] if de_buf is not None else de[sl]
            part.zero_()
            kernels.cce_backward(
                e[sl], c, bias, targets[sl], lse[sl], a[sl], b[sl],
                uniform_in_kernel[sl] if uniform_in_kernel is not None else None,
                thr[sl] if thr is not None else None, perm, mu, part, dc, db, None,
                v_lo=0, v_hi=v, dc_by_position=False, **common,
            )
            de[sl] = finish(part, sl)
        del de_buf
    else:
        fixed = acc == "fixed"
        buf_dtype = torch.int64 if fixed else torch.float32
        db = torch.zeros(v, device=c.device, dtype=buf_dtype) if bias is not None else None
        scales = _fixed_point_scales(e, c, a, b, u, cfg.vocab_size, comm) if fixed else None
        de_buf = torch.zeros(e.shape, device=e.device, dtype=buf_dtype)
        dc = torch.empty_like(c)
        # The vocabulary goes in bwd_v_chunks launches, so the fp32 / int64 dC buffer is a chunk.
        chunk = -(-v // kcfg.bwd_v_chunks)
        chunk = -(-chunk // kcfg.bwd_block_v) * kcfg.bwd_block_v
        dc_buf = torch.empty((min(chunk, v), c.shape[1]), device=c.device, dtype=buf_dtype)
        for lo in range(0, v, chunk):
            hi = min(v, lo + chunk)
            part = dc_buf[: hi - lo]
            part.zero_()
            kernels.cce_backward(
                e, c, bias, targets, lse, a, b, uniform_in_kernel, thr, perm, mu, de_buf, part, db, scales,
                v_lo=lo, v_hi=hi, dc_by_position=True, **common,
            )
            val = part.float() * (1.0 / scales[1]) if fixed else part
            dc[perm[lo:hi] if perm is not None else slice(lo, hi)] = val.to(c.dtype)
        del dc_buf
        if fixed:
            if reduce_de:
                comm.all_sum_(de_buf)  # int64: exact, so the sum over ranks is order-free too
            # "exact" filters nothing, so there is no outside term to add.
            de = de_buf.float() * (1.0 / scales[0])
            db = db.float() * (1.0 / scales[2]) if db is not None else None
        else:
            de = finish(de_buf, slice(None))
        de = de.to(de_dtype)
    if u_outside is not None:
        dc -= (e.t() @ u_outside.to(e.dtype)).to(dc.dtype)[None, :]
        if db is not None:
            db -= u_outside.sum()
    if acc == "fixed":
        _propagate_nan(lse, de, dc, db)
    return de, dc, db.to(bias.dtype) if db is not None else None


def _workspace_outputs(e, c, bias, a, b, u_in):
    """(dE fp32 accumulator, dC, dbias fp32 or None, scale, scale as a tensor) of the workspace paths.

    Only fp16 needs the workspace scaled (its range): scale is then a power of two (a one-element
    tensor), else None, and the GEMMs need no rescale (the tensor form is 1)."""
    from cce_parallel import kernels

    f32 = dict(device=e.device, dtype=torch.float32)
    db = torch.zeros(c.shape[0], **f32) if bias is not None else None
    scale = kernels.ws_scale(a, b, u_in) if e.dtype == torch.float16 else None
    one = torch.ones(1, **f32) if scale is None else scale
    return torch.zeros(e.shape, **f32), torch.empty_like(c), db, scale, one


def _workspace_backward(e, c, bias, targets, lse, a, b, u_in, thr, perm, mu, filter_e, filter_c, cfg, finish):
    """The block-sparse workspace backward (kernels/backward_ws.py): one chunk of vocabulary
    positions at a time, no atomics; dE in an fp32 buffer, dC and dbias written once per row."""
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, v = e.shape[0], c.shape[0]
    bn, bv = kcfg.bwd_block_n, kcfg.bwd_block_v
    vc = logit_chunk(n, v, kcfg.bwd_workspace_bytes, e.element_size(), bv)
    ws = torch.empty((n, vc), device=e.device, dtype=e.dtype)
    mask = torch.empty((-(-n // bn), vc // bv), device=e.device, dtype=torch.int8)
    de, dc, db, scale, one = _workspace_outputs(e, c, bias, a, b, u_in)
    for lo in range(0, v, vc):
        hi = min(v, lo + vc)
        kernels.cce_backward_ws(
            e, c, bias, targets, lse, a, b, u_in, thr, perm, mu, one, de, dc, db, ws, mask,
            softcap=cfg.softcap, v_lo=lo, v_hi=hi, filter_e=filter_e, filter_c=filter_c, config=kcfg,
        )
    del ws, mask
    return finish(de, slice(None)), dc, db


def _dense_backward(e, c, bias, targets, lse, a, b, u_in, cfg, finish):
    """The dense-GEMM backward: per vocabulary chunk and block of tokens, the library GEMM recomputes
    the fp32 logits, one Triton pass turns them into the logit gradient (input dtype), and two more
    GEMMs add it to dE (fp32, in place) and dC. dC is summed over all tokens before it is rounded:
    in one GEMM when the tokens form one block, else in an fp32 buffer of one chunk's rows."""
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, d = e.shape
    v = c.shape[0]
    # The budget holds a chunk's fp32 logits and its logit gradient. With several token blocks, dC
    # is summed in an fp32 buffer of the chunk's rows (dense_min_cols x D floats, ~9 MB at D=2304).
    nt, vc = dense_blocks(n, v, kcfg.bwd_workspace_bytes, e.element_size() + 4, kcfg.bwd_block_v, kcfg.dense_min_cols)
    split = nt < n
    ws = torch.empty((nt, vc), device=e.device, dtype=e.dtype)
    x = torch.empty((nt, vc), device=e.device, dtype=torch.float32)
    dc_sum = torch.empty((vc, d), device=e.device, dtype=torch.float32) if split else None
    de, dc, db, scale, one = _workspace_outputs(e, c, bias, a, b, u_in)
    for lo in range(0, v, vc):
        hi = min(v, lo + vc)
        for t0 in range(0, n, nt):
            rows = slice(t0, min(n, t0 + nt))
            k = rows.stop - t0
            logits_into(x[:k, : hi - lo], e[rows], c[lo:hi])
            kernels.dz_from_logits(
                x[:k, : hi - lo], bias, targets[rows], lse[rows], a[rows], b[rows],
                u_in[rows] if u_in is not None else None, one, ws[:k], softcap=cfg.softcap, v_lo=lo, v_hi=hi,
                config=kcfg,
            )
            _dense_products(
                ws[:k, : hi - lo], e[rows], c[lo:hi], scale, de[rows], dc_sum[: hi - lo] if split else dc[lo:hi],
                db[lo:hi] if db is not None else None, first=t0 == 0,
            )
        if split:
            dc[lo:hi] = dc_sum[: hi - lo].div_(scale) if scale is not None else dc_sum[: hi - lo]
    del ws, x, dc_sum
    if db is not None and scale is not None:
        db.div_(scale)
    return finish(de, slice(None)), dc, db


def _dense_products(ws, e, c_rows, scale, de, dc_rows, db_rows, first=True):
    """One block's two products with dense library GEMMs; ws [n, rows] holds dz (times `scale`, a
    power of two, for fp16 inputs; None means 1).

    de [n, D] fp32 += ws @ c_rows, accumulated in fp32. dc_rows: in the input dtype, = ws^T @ e
    (rounded once, divided by scale); in fp32, a running sum over token blocks (= on the first
    block, += after; still times scale). db_rows fp32 += the column sums of ws (times scale).
    """
    fused = _fp32_out_addmm(ws.device)
    if ws.dtype == torch.float32:
        de.addmm_(ws, c_rows)  # fp32 inputs are never scaled
    elif scale is None and fused:
        torch.addmm(de, ws, c_rows, out_dtype=torch.float32, out=de)
    else:
        part = torch.mm(ws, c_rows, out_dtype=torch.float32)
        de.add_(part.div_(scale) if scale is not None else part)
    if dc_rows.dtype != torch.float32 or ws.dtype == torch.float32:
        if not first:
            dc_rows.addmm_(ws.t(), e)  # fp32 inputs
        elif scale is None:
            torch.mm(ws.t(), e, out=dc_rows)
        else:
            dc_rows.copy_(torch.mm(ws.t(), e, out_dtype=torch.float32).div_(scale))
    elif first:
        torch.mm(ws.t(), e, out_dtype=torch.float32, out=dc_rows)
    elif fused:
        torch.addmm(dc_rows, ws.t(), e, out_dtype=torch.float32, out=dc_rows)
    else:
        dc_rows.add_(torch.mm(ws.t(), e, out_dtype=torch.float32))
    if db_rows is not None:
        db_rows.add_(ws.sum(dim=0, dtype=torch.float32))


@functools.lru_cache(maxsize=None)
def _fp32_out_addmm(device) -> bool:
    """Whether torch.addmm takes bf16/fp16 operands with an fp32 accumulator in place (out_dtype)."""
    try:
        acc = torch.zeros((2, 2), device=device, dtype=torch.float32)
        x = torch.ones((2, 2), device=device, dtype=torch.bfloat16)
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0].item() == 2.0)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def torch_backward(e, c, bias, targets, lse, a, b, u, cfg: LossConfig, comm=SINGLE, reduce_de=True):
    """The PyTorch reference's backward with the same dE contract as triton_backward."""
    de, dc, db = reference.backward(e, c, bias, targets, lse, a, b, u, cfg.softcap)
    if reduce_de:
        comm.all_sum_(de)
        return de.to(e.dtype), dc, db
    return de, dc, db


# ----------------------------------------------------------------------------------------------
# the Function


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss and log-sum-exp, fp32, for all n tokens (0 at ignored ones).

    e: [n_rows, D] (this rank's rows under sequence parallelism, else all n); c: [V_shard, D];
    bias: [V_shard] or None; targets: [n] int64, the row of c holding each token's target, or any
    value outside [0, V_shard) when another rank holds it; keep: [n_kept] int64 indices of the
    tokens that count, or None for all.
    """

    @staticmethod
    def forward(ctx, e, c, bias, targets, keep, cfg: LossConfig, comm: Collectives, sequence_parallel: bool):
        e_all = comm.gather_rows(e) if sequence_parallel else e
        n = e_all.shape[0]
        e_k = e_all if keep is None else e_all.index_select(0, keep)
        t_k = targets if keep is None else targets.index_select(0, keep)
        mx, se, zt, zsum, perm = local_stats(e_k, c, bias, t_k, cfg)
        m, se, zt, zsum = _combine(mx, se, zt, zsum, comm)
        lse = m + torch.log(se)
        loss = token_loss(lse, zt, zsum, cfg)
        if keep is not None:
            loss = loss.new_zeros(n).index_copy_(0, keep, loss)
            lse_out = lse.new_zeros(n).index_copy_(0, keep, lse)
        else:
            lse_out = lse
        ctx.cfg, ctx.comm, ctx.sp, ctx.n = cfg, comm, sequence_parallel, n
        ctx.save_for_backward(e_k, c, bias, t_k, keep, lse, zt, perm)
        return loss, lse_out

    @staticmethod
    def backward(ctx, g_loss, g_lse):
        e_k, c, bias, t_k, keep, lse, zt, perm = ctx.saved_tensors
        cfg, comm, sp = ctx.cfg, ctx.comm, ctx.sp

        def kept(g):
            if g is None:
                return None
            g = g.float()
            return g if keep is None else g.index_select(0, keep)

        g_loss = kept(g_loss) if g_loss is not None else torch.zeros_like(lse)
        a, b, u = coefficients(g_loss, kept(g_lse), lse, cfg)
        if cfg.use_triton:
            de, dc, db = triton_backward(e_k, c, bias, t_k, lse, zt, a, b, u, perm, cfg, comm, reduce_de=not sp)
        else:
            de, dc, db = torch_backward(e_k, c, bias, t_k, lse, a, b, u, cfg, comm, reduce_de=not sp)
        if keep is not None:
            de = de.new_zeros((ctx.n, de.shape[1])).index_copy_(0, keep, de)
        if sp:
            # fp32 partial sums over this rank's vocabulary -> this rank's rows of the full sum.
            de = comm.sum_scatter_rows(de).to(e_k.dtype)
        return de, dc, db, None, None, None, None, None
