"""The lean path: the forward folds fp32 logit chunks into the statistics; the backward recomputes
them and adds dE and dC chunk by chunk. Four logit-sized GEMMs, memory within about 100 MB of dE +
dC. It serves logits_budget=0, calls where nothing needs a gradient, a gradient through lse, a
recompute for per-token weights when the forward rounded dE to bf16, and a loss scale that keeps
changing.
"""

import torch

from cce_parallel.ops import reference
from cce_parallel.ops.common import SINGLE, LossConfig, _combine, _mm_into, dense_blocks, logits_into


class _Partials:
    """The lean forward's [S, N] partial statistics, one row per (vocabulary chunk, column slice).

    At most `rows` rows are kept: when the next chunk would not fit, the rows so far are folded into
    the first one (as _combine does at the end), so that S does not grow with V / chunk."""

    def __init__(self, rows: int, n: int, need_zsum: bool, device, need_pz: bool = False):
        f32 = dict(device=device, dtype=torch.float32)
        # Every launched slice writes all its rows (an empty slice writes max -inf, sums 0).
        self.mx = torch.full((rows, n), float("-inf"), **f32)
        self.se, self.zt = torch.zeros((rows, n), **f32), torch.zeros((rows, n), **f32)
        self.zsum = torch.zeros((rows, n), **f32) if need_zsum else None
        self.pz = torch.zeros((rows, n), **f32) if need_pz else None
        self.used = 0

    def reserve(self, k: int) -> int:
        """The first of k free rows."""
        if self.used + k > self.mx.shape[0]:
            mx, se, zt, zsum, pz = self.rows()
            m = mx.max(dim=0).values  # the true max: _combine's is 0 where it is not finite
            _, self.se[0], self.zt[0], zsum, pz = _combine(mx, se, zt, zsum, SINGLE, dim=0, pz=pz)
            self.mx[0] = m
            if zsum is not None:
                self.zsum[0] = zsum
            if pz is not None:
                self.pz[0] = pz
            self.used = 1
        first, self.used = self.used, self.used + k
        return first

    def rows(self):
        u = max(self.used, 1)
        return (self.mx[:u], self.se[:u], self.zt[:u], self.zsum[:u] if self.zsum is not None else None,
                self.pz[:u] if self.pz is not None else None)


def local_stats(e, c, bias, targets, cfg: LossConfig):
    """(max, sumexp, zt, zsum, pz) of each token over the rows of c (this rank's shard), from fp32
    logit chunks of at most fwd_chunk_bytes: vocabulary chunks, each over blocks of tokens. zsum
    with label smoothing, pz (sum exp(z - max) z) with cfg.entropy, else None."""
    need_zsum = cfg.label_smoothing > 0
    if not cfg.use_triton:
        return reference.forward_stats(e, c, bias, targets, cfg.softcap, need_zsum=need_zsum,
                                       temperature=cfg.temperature, need_pz=cfg.entropy)
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, v = e.shape[0], c.shape[0]
    nt, vc = dense_blocks(n, v, kcfg.fwd_chunk_bytes, 4, kcfg.fwd_block_v, kcfg.dense_min_cols)
    slices = kernels.stats_slices(nt, vc, kcfg, e.is_cuda)
    # Room for a quarter of the chunk budget, and at least two chunks' rows.
    cap = max(2 * slices, min(max(1, -(-v // vc)) * slices, kcfg.fwd_chunk_bytes // 4 // (16 * max(n, 1))))
    part = _Partials(cap, n, need_zsum, e.device, need_pz=cfg.entropy)
    if n > 0 and v > 0:
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
                    config=kcfg, temperature=cfg.temperature,
                    pz=part.pz[:, cols] if cfg.entropy else None,
                )
    mx, se, zt, zsum, pz = part.rows()
    return _combine(mx, se, zt, zsum, SINGLE, dim=0, pz=pz)


def lean_backward(e, c, bias, targets, lse, a, b, u, cfg: LossConfig, need_de=True, dc_out=None, h=None):
    """(dE fp32 partial over this rank's vocabulary or None, dC in c's dtype, dbias fp32 or None):
    per vocabulary chunk and block of tokens, the library GEMM recomputes the fp32 logits, one
    Triton pass turns them into the logit gradient (input dtype), and GEMMs add it to dE (fp32) and
    dC. dC is summed over all tokens before it is rounded: in one GEMM when the tokens form one
    block, else in an fp32 buffer of one chunk's rows. dc_out: an fp32 [V, D] tensor that dC is
    added to (not rounded) and returned as dC, or None. h: None, or each token's coefficient of
    -p z, an entropy term's (tiles.logit_grad)."""
    if not cfg.use_triton:
        de, dc, db = reference.backward(e, c, bias, targets, lse, a, b, u, cfg.softcap, dc_out=dc_out,
                                        temperature=cfg.temperature, coef_h=h)
        return (de if need_de else None), dc, db
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, d = e.shape
    v = c.shape[0]
    f32 = dict(device=e.device, dtype=torch.float32)
    de = torch.zeros(e.shape, **f32) if need_de else None
    db = torch.zeros(v, **f32) if bias is not None else None
    if n == 0:
        return de, dc_out if dc_out is not None else torch.zeros_like(c), db
    # The budget holds a chunk's fp32 logits and its logit gradient. With several token blocks, dC
    # is summed in an fp32 buffer of the chunk's rows (dense_min_cols x D floats, ~9 MB at D=2304).
    nt, vc = dense_blocks(n, v, kcfg.bwd_workspace_bytes, e.element_size() + 4, kcfg.bwd_block_v, kcfg.dense_min_cols)
    split = nt < n
    dc = torch.empty_like(c) if dc_out is None else dc_out
    ws = torch.empty((nt, vc), device=e.device, dtype=e.dtype)
    x = torch.empty((nt, vc), **f32)
    dc_sum = torch.empty((vc, d), **f32) if split else None
    # fp16 logit gradients are scaled by a power of two (kernels.grad_scale); 1 otherwise.
    fp16 = e.dtype == torch.float16
    scale = kernels.grad_scale(a, b, u) if fp16 else torch.ones(1, **f32)
    add = dc_out is not None
    for lo in range(0, v, vc):
        hi = min(v, lo + vc)
        for t0 in range(0, n, nt):
            rows = slice(t0, min(n, t0 + nt))
            k = rows.stop - t0
            g = ws[:k, : hi - lo]
            logits_into(x[:k, : hi - lo], e[rows], c[lo:hi])
            kernels.dz_from_logits(
                x[:k, : hi - lo], bias, targets[rows], lse[rows], a[rows], b[rows],
                u[rows] if u is not None else None, scale, ws[:k], softcap=cfg.softcap, v_lo=lo, v_hi=hi,
                config=kcfg, temperature=cfg.temperature, coef_h=h[rows] if h is not None else None,
            )
            if de is not None:
                if fp16:
                    de[rows] += torch.mm(g, c[lo:hi], out_dtype=torch.float32).div_(scale)
                else:
                    _mm_into(de[rows], g, c[lo:hi], accumulate=True)
            if split:
                _mm_into(dc_sum[: hi - lo], g.t(), e[rows], accumulate=t0 > 0)
            elif fp16:
                part = torch.mm(g.t(), e[rows], out_dtype=torch.float32).div_(scale)
                dc[lo:hi] = dc[lo:hi] + part if add else part
            elif add:
                _mm_into(dc[lo:hi], g.t(), e[rows], accumulate=True)
            else:
                torch.mm(g.t(), e[rows], out=dc[lo:hi])  # fp32 accumulation, rounded once
            if db is not None:
                db[lo:hi] += g.sum(dim=0, dtype=torch.float32).div_(scale)
        if split:
            part = dc_sum[: hi - lo].div_(scale)
            dc[lo:hi] = dc[lo:hi] + part if add else part
    return de, dc, db
