"""Blockwise CCE backward: recompute the logits, form d loss / d logits, accumulate dE, dC, dbias
(paper Algorithms 3 and 4, with the indexed-dot backward merged in).

Math, for token n, vocabulary row v of this shard, with the global log-sum-exp lse[n]:

    p[n, v]  = exp(z[n, v] - lse[n])
    dz[n, v] = A[n] * p[n, v] - B[n] * [v == target[n]] - U[n]
    dx[n, v] = dz[n, v] * (1 - (z[n, v] / softcap)**2)          (softcap chain rule; dx = dz without)
    dE[n]   += sum_v dx[n, v] * C[v]
    dC[v]   += sum_n dx[n, v] * E[n]
    dbias[v] += sum_n dx[n, v]

A, B, U are per-token coefficients the caller derives from the upstream gradients, z-loss and label
smoothing (see ops/autograd.py). The uniform term U is only passed here when it cannot be applied
outside the kernel (softcap with label smoothing).

Grid: one program per [BLOCK_N, BLOCK_V] tile, 1-D and grouped GROUP_N token blocks at a time so that
neighbouring programs share C tiles in L2. Each program recomputes its logit tile over D
(BLOCK_D steps, fp32 accumulation), then walks D again to add its share of dE and dC.

Vocabulary positions: the program's columns are positions [v_lo, v_hi) of an ordering of the shard.
With SORTED the ordering is Perm (vocabulary sorted by average logit, so that the few columns with a
non-negligible softmax sit in the same tiles); otherwise it is the identity.

Gradient filtering (FILTER_E / FILTER_C): a tile is skipped for dE / dC when it holds no target and,
for every row n, the tile's probability mass sum_v p[n, v] (its largest p[n, v] with FILTER_BY_MAX)
is below the row's threshold Thr[n]. The
caller sets Thr[n] = eps * sum_v |dz[n, v]| / |A[n]|, so what a skipped tile would add to a row is
below eps relative to the L1 mass of that row's logit gradient. (A fixed threshold on p would not be
relative: when the model is confident, p[target] ~ 1 and the gradient is the small residual
1 - p[target], of which the dropped tail is a sizeable part.)

Centring (CENTER_E): the skipped tiles of a row add up. Their sum is dominated by what the
classifier rows share, their mean Mu, because sum_v dz[n, v] C[v] = sum_v dz[n, v] (C[v] - Mu)
+ Mu * sum_v dz[n, v], and sum_v dz[n, v] = A[n] - B[n] is known exactly. With CENTER_E the kernel
accumulates only the centred products; the caller adds Mu * (A - B). What filtering then drops is
the part of the tail that the shared direction does not explain.

Accumulation into global memory, chosen by the caller through the output pointers' dtypes:
  * the gradient dtype (bf16/fp16/fp32 atomics): the paper's plain CCE;
  * fp32 buffers: the compensated modes (more precise than the paper's bf16 Kahan pair);
  * FIXED_POINT: int64 atomics of round-toward-zero(value * scale). Integer addition is associative,
    so the result is bit-identical from run to run whatever order the tiles finish in; the caller
    picks scale = 2**62 / (a bound on the sum of |contributions|), so nothing can overflow.
DC_BY_POSITION writes dC rows at (position - v_lo), i.e. into a buffer that covers only this
launch's chunk of positions, instead of at the vocabulary row.

All offsets are int64.
"""

import triton
import triton.language as tl

from cce_parallel.kernels.tiles import activate, dot_precision, keep_tile, logit_grad, logit_tile, probs_tile


@triton.jit
def _accumulate(ptrs, part, mask, scale, FIXED_POINT: tl.constexpr):
    if FIXED_POINT:
        tl.atomic_add(ptrs, (part * scale).to(tl.int64), mask=mask)
    else:
        tl.atomic_add(ptrs, part.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _cce_backward_kernel(
    E_ptr,  # [N, D] hidden states, read-only
    C_ptr,  # [V, D] classifier rows of this shard, read-only
    Bias_ptr,  # [V] bias (dummy unless HAS_BIAS)
    Tgt_ptr,  # [N] int64 target row in this shard, outside [0, V) when not here
    Lse_ptr,  # [N] fp32 global log-sum-exp
    A_ptr,  # [N] fp32 coefficient of p
    B_ptr,  # [N] fp32 coefficient of the one-hot target
    U_ptr,  # [N] fp32 uniform coefficient (dummy unless HAS_UNIFORM)
    Thr_ptr,  # [N] fp32 per-row probability threshold (dummy unless FILTER_E or FILTER_C)
    Perm_ptr,  # [V] int64 position -> vocabulary row (dummy unless SORTED)
    Mu_ptr,  # [D] fp32 mean classifier row (dummy unless CENTER_E)
    DE_ptr,  # [N, D] dE accumulator: gradient dtype, fp32 or int64 (FIXED_POINT)
    DC_ptr,  # [V or v_hi - v_lo, D] dC accumulator, same dtype rules
    DB_ptr,  # [V] dbias accumulator, fp32 or int64 (dummy unless HAS_BIAS)
    Scale_ptr,  # [3] fp32 fixed-point scales for dE, dC, dbias (dummy unless FIXED_POINT)
    softcap,
    N,
    V,
    D,
    v_lo,
    v_hi,
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    stride_den,
    stride_ded,
    stride_dcv,
    stride_dcd,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    SORTED: tl.constexpr,
    FILTER_E: tl.constexpr,
    FILTER_C: tl.constexpr,
    CENTER_E: tl.constexpr,
    FILTER_BY_MAX: tl.constexpr,
    FIXED_POINT: tl.constexpr,
    DC_BY_POSITION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    # Grouped ordering: GROUP_N token blocks sweep the vocabulary together.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_v = tl.cdiv(v_hi - v_lo, BLOCK_V)
    per_group = GROUP_N * num_v
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = (first_n + (pid % per_group) % group_size).to(tl.int64)
    pid_v = ((pid % per_group) // group_size).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    pos = v_lo + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = pos < v_hi
    if SORTED:
        rows = tl.load(Perm_ptr + pos, mask=mask_v, other=0)
    else:
        rows = pos
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_n[:, None] & mask_v[None, :]

    x = logit_tile(
        E_ptr, C_ptr, offs_n, mask_n, rows, mask_v, D, stride_en, stride_ed, stride_cv, stride_cd,
        DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D,
    )
    z, t = activate(x, Bias_ptr, rows, mask_v, softcap, HAS_BIAS, HAS_SOFTCAP)
    p, is_t = probs_tile(z, Lse_ptr, Tgt_ptr, offs_n, mask_n, rows, mask)

    # do_e / do_c are compile-time True when that gradient is unfiltered, else the runtime test.
    if FILTER_E or FILTER_C:
        keep = keep_tile(p, is_t, Thr_ptr, offs_n, mask_n, FILTER_BY_MAX)
    else:
        keep = True
    if FILTER_E:
        do_e = keep
    else:
        do_e = True
    if FILTER_C:
        do_c = keep
    else:
        do_c = True
    if FILTER_E and FILTER_C:
        do_any = keep
    else:
        do_any = True

    if do_any:
        dz = logit_grad(p, is_t, t, offs_n, mask_n, A_ptr, B_ptr, U_ptr, HAS_UNIFORM, HAS_SOFTCAP)
        dz = tl.where(mask, dz, 0.0)
        if FIXED_POINT:
            scale_e = tl.load(Scale_ptr + 0)
            scale_c = tl.load(Scale_ptr + 1)
            scale_b = tl.load(Scale_ptr + 2)
        else:
            scale_e = 1.0
            scale_c = 1.0
            scale_b = 1.0
        if HAS_BIAS:
            if do_c:
                _accumulate(DB_ptr + rows, tl.sum(dz, axis=0), mask_v, scale_b, FIXED_POINT)
        # Products run in the input dtype on tensor cores with fp32 accumulation, as a plain
        # low-precision matmul of the logit gradient would.
        dz_lp = dz.to(E_ptr.dtype.element_ty)
        if DC_BY_POSITION:
            dc_rows = pos - v_lo
        else:
            dc_rows = rows
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            mask_d = dd < D
            if do_e:
                c = tl.load(
                    C_ptr + rows[:, None] * stride_cv + dd[None, :] * stride_cd,
                    mask=mask_v[:, None] & mask_d[None, :],
                    other=0.0,
                )
                de = tl.dot(dz_lp, c, input_precision=DOT_PRECISION)
                if CENTER_E:
                    mu = tl.load(Mu_ptr + dd, mask=mask_d, other=0.0)
                    de -= tl.sum(dz, axis=1)[:, None] * mu[None, :]
                _accumulate(
                    DE_ptr + offs_n[:, None] * stride_den + dd[None, :] * stride_ded,
                    de,
                    mask_n[:, None] & mask_d[None, :],
                    scale_e,
                    FIXED_POINT,
                )
            if do_c:
                e = tl.load(
                    E_ptr + offs_n[:, None] * stride_en + dd[None, :] * stride_ed,
                    mask=mask_n[:, None] & mask_d[None, :],
                    other=0.0,
                )
                dc = tl.dot(tl.trans(dz_lp), e, input_precision=DOT_PRECISION)
                _accumulate(
                    DC_ptr + dc_rows[:, None] * stride_dcv + dd[None, :] * stride_dcd,
                    dc,
                    mask_v[:, None] & mask_d[None, :],
                    scale_c,
                    FIXED_POINT,
                )


def cce_backward(
    e,
    c,
    bias,
    targets,
    lse,
    coef_a,
    coef_b,
    coef_u,
    threshold,
    perm,
    mu,
    de,
    dc,
    db,
    scales,
    *,
    softcap,
    v_lo,
    v_hi,
    filter_e: bool,
    filter_c: bool,
    dc_by_position: bool,
    config,
):
    """Launch the backward kernel over vocabulary positions [v_lo, v_hi).

    Args:
        e [N, D], c [V, D], bias [V] or None, targets [N] int64 (row in this shard or out of range),
        lse/coef_a/coef_b [N] fp32, coef_u [N] fp32 or None, perm [V] int64 or None.
        threshold: [N] fp32 per-row probability threshold, or None when nothing is filtered.
        mu: [D] fp32 mean row of c to centre dE on (CENTER_E), or None.
        de [N, D], dc [V or v_hi - v_lo, D], db [V] or None: accumulators, already initialised.
        scales: [3] fp32 tensor for int64 accumulators, or None.
    """
    N, D = e.shape
    V = c.shape[0]
    if N == 0 or v_hi <= v_lo:
        return
    bn, bv, bd = config.bwd_block_n, config.bwd_block_v, config.bwd_block_d
    grid = (triton.cdiv(N, bn) * triton.cdiv(v_hi - v_lo, bv),)
    dummy = lse
    _cce_backward_kernel[grid](
        e,
        c,
        bias if bias is not None else dummy,
        targets,
        lse,
        coef_a,
        coef_b,
        coef_u if coef_u is not None else dummy,
        threshold if threshold is not None else dummy,
        perm if perm is not None else targets,
        mu if mu is not None else dummy,
        de,
        dc,
        db if db is not None else dummy,
        scales if scales is not None else dummy,
        float(softcap) if softcap is not None else 1.0,
        N,
        V,
        D,
        v_lo,
        v_hi,
        e.stride(0),
        e.stride(1),
        c.stride(0),
        c.stride(1),
        de.stride(0),
        de.stride(1),
        dc.stride(0),
        dc.stride(1),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_UNIFORM=coef_u is not None,
        SORTED=perm is not None,
        FILTER_E=filter_e,
        FILTER_C=filter_c,
        CENTER_E=mu is not None,
        FILTER_BY_MAX=bool(config.bwd_filter_by_max),
        FIXED_POINT=scales is not None,
        DC_BY_POSITION=dc_by_position,
        DOT_PRECISION=dot_precision(e.dtype),
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_D=bd,
        GROUP_N=config.bwd_group_n,
        num_warps=config.bwd_num_warps,
        num_stages=config.bwd_num_stages,
    )
