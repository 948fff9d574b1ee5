"""CCE backward through a bounded workspace: no atomics, every sum in fixed order.

The tile-wise backward (backward.py) adds each kept tile's dE and dC partials to global memory:
when most tiles are kept that traffic, not the arithmetic, sets the pace. Here the vocabulary is
processed in chunks of Vc positions, each in three launches:

  1. _dlogits_kernel, grid (cdiv(N, BLOCK_N), cdiv(Vc, BLOCK_V)): recompute a logit tile, form
     dz = A p - B [v == target] (- U) (through the softcap), write it in the input dtype to the
     workspace WS [N, Vc] and a per-tile flag Mask [cdiv(N, BLOCK_N), cdiv(Vc, BLOCK_V)]
     (bit 0: dE needs the tile, bit 1: dC needs it; filtering as in backward.py). Skipped tiles
     are not written.
  2. _ws_de_kernel, grid (cdiv(N, BLOCK_N), cdiv(D, BLOCK_DO)): DE[rows, cols] += WS[rows, :] @ C[chunk, cols],
     a GEMM over the chunk that skips tiles without bit 0 (centred on Mu when CENTER_E). Each
     program owns its output block: a plain fp32 read-modify-write.
  3. _ws_dc_kernel, grid (cdiv(Vc, BLOCK_V), cdiv(D, BLOCK_DO)): DC[chunk rows, cols] = WS[:, chunk]^T @ E[:, cols],
     summed over all N tokens in registers and written once (plus dbias from the first column block).

The workspace holds dz times a power of two that brings the largest |A|, |B|, |U| to ~1 (dz would
otherwise sit in fp16's subnormals under a mean over many tokens); the GEMMs divide it out.

Memory: the workspace (N * Vc * 2 bytes, Vc from the caller's byte budget) and an fp32 dE buffer.
Every reduction runs in a fixed order, so the result is bit-identical from run to run.
All offsets are int64.
"""

import torch
import triton
import triton.language as tl

from cce_parallel.kernels.tiles import activate, dot_precision, keep_tile, logit_grad, logit_tile, probs_tile


@triton.jit
def _dlogits_kernel(
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
    Scale_ptr,  # [1] fp32 power of two the workspace is scaled by
    WS_ptr,  # [N, Vc] out: scale * d loss / d logits of the chunk, input dtype
    Mask_ptr,  # [cdiv(N, BLOCK_N), cdiv(Vc, BLOCK_V)] int8 out: bit 0 dE, bit 1 dC
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
    stride_wn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    SORTED: tl.constexpr,
    FILTER_E: tl.constexpr,
    FILTER_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # position within the chunk
    pos = v_lo + local
    mask_v = pos < v_hi
    if SORTED:
        rows = tl.load(Perm_ptr + pos, mask=mask_v, other=0)
    else:
        rows = pos
    mask = mask_n[:, None] & mask_v[None, :]

    x = logit_tile(
        E_ptr, C_ptr, offs_n, mask_n, rows, mask_v, D, stride_en, stride_ed, stride_cv, stride_cd,
        DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D,
    )
    z, t = activate(x, Bias_ptr, rows, mask_v, softcap, HAS_BIAS, HAS_SOFTCAP)
    p, is_t = probs_tile(z, Lse_ptr, Tgt_ptr, offs_n, mask_n, rows, mask)

    # The same relative, summed-mass test as backward.py.
    if FILTER_E or FILTER_C:
        keep = keep_tile(p, is_t, Thr_ptr, offs_n, mask_n, False).to(tl.int8)
    else:
        keep = tl.full([], 1, tl.int8)
    if FILTER_E:
        flag_e = keep
    else:
        flag_e = tl.full([], 1, tl.int8)
    if FILTER_C:
        flag_c = keep
    else:
        flag_c = tl.full([], 1, tl.int8)
    flags = flag_e + 2 * flag_c
    tl.store(Mask_ptr + pid_n * stride_mn + pid_v, flags)
    if flags != 0:
        dz = logit_grad(p, is_t, t, offs_n, mask_n, A_ptr, B_ptr, U_ptr, HAS_UNIFORM, HAS_SOFTCAP)
        # Scaled so the largest coefficient is ~1: with a mean over many tokens, unscaled fp16 dz
        # would fall into fp16's subnormals. A power of two, so nothing else is rounded.
        dz = tl.where(mask, dz * tl.load(Scale_ptr), 0.0)
        # The workspace is padded to whole tiles, so only rows need a mask (padding stores zeros).
        tl.store(
            WS_ptr + offs_n[:, None] * stride_wn + local[None, :],
            dz.to(WS_ptr.dtype.element_ty),
            mask=mask_n[:, None],
        )


@triton.jit
def _ws_de_kernel(
    WS_ptr,  # [N, Vc] chunk's logit gradient, read-only
    Mask_ptr,  # [cdiv(N, BLOCK_N), cdiv(Vc, BLOCK_V)] int8 tile flags, read-only
    C_ptr,  # [V, D] classifier rows of this shard, read-only
    Perm_ptr,  # [V] int64 position -> row (dummy unless SORTED)
    Mu_ptr,  # [D] fp32 mean classifier row (dummy unless CENTER_E)
    Scale_ptr,  # [1] fp32 the workspace's scale
    DE_ptr,  # [N, D] fp32 in/out, this program's block only
    N,
    D,
    v_lo,
    v_hi,
    stride_wn,
    stride_mn,
    stride_cv,
    stride_cd,
    stride_den,
    SORTED: tl.constexpr,
    CENTER_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_DO: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_d = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_N, BLOCK_DO], tl.float32)
    rowsum = tl.zeros([BLOCK_N], tl.float32)
    num_v = tl.cdiv(v_hi - v_lo, BLOCK_V)
    for k in range(0, num_v):
        flags = tl.load(Mask_ptr + pid_n * stride_mn + k)
        if (flags & 1) != 0:
            local = k * BLOCK_V + tl.arange(0, BLOCK_V)
            pos = v_lo + local
            mask_v = pos < v_hi
            if SORTED:
                rows = tl.load(Perm_ptr + pos, mask=mask_v, other=0)
            else:
                rows = pos
            ds = tl.load(
                WS_ptr + offs_n[:, None] * stride_wn + local[None, :],
                mask=mask_n[:, None] & mask_v[None, :],
                other=0.0,
            )
            c = tl.load(
                C_ptr + rows[:, None] * stride_cv + offs_d[None, :] * stride_cd,
                mask=mask_v[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = tl.dot(ds, c, acc, input_precision=DOT_PRECISION)
            if CENTER_E:
                rowsum += tl.sum(ds.to(tl.float32), axis=1)
    if CENTER_E:
        mu = tl.load(Mu_ptr + offs_d, mask=mask_d, other=0.0)
        acc -= rowsum[:, None] * mu[None, :]
    acc = acc / tl.load(Scale_ptr)
    ptrs = DE_ptr + offs_n[:, None] * stride_den + offs_d[None, :]
    m = mask_n[:, None] & mask_d[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=m, other=0.0) + acc, mask=m)


@triton.jit
def _ws_dc_kernel(
    WS_ptr,  # [N, Vc] chunk's logit gradient, read-only
    Mask_ptr,  # [cdiv(N, BLOCK_N), cdiv(Vc, BLOCK_V)] int8 tile flags, read-only
    E_ptr,  # [N, D] hidden states, read-only
    Perm_ptr,  # [V] int64 position -> row (dummy unless SORTED)
    Scale_ptr,  # [1] fp32 the workspace's scale
    DC_ptr,  # [V, D] out: rows of this chunk, written once
    DB_ptr,  # [V] fp32 out: dbias of this chunk's rows (dummy unless HAS_BIAS)
    N,
    D,
    v_lo,
    v_hi,
    stride_wn,
    stride_mn,
    stride_en,
    stride_ed,
    stride_dcv,
    HAS_BIAS: tl.constexpr,
    SORTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_DO: tl.constexpr,
):
    pid_v = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    pos = v_lo + local
    mask_v = pos < v_hi
    if SORTED:
        rows = tl.load(Perm_ptr + pos, mask=mask_v, other=0)
    else:
        rows = pos
    offs_d = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_V, BLOCK_DO], tl.float32)
    colsum = tl.zeros([BLOCK_V], tl.float32)
    for j in range(0, tl.cdiv(N, BLOCK_N)):
        flags = tl.load(Mask_ptr + j * stride_mn + pid_v)
        if (flags & 2) != 0:
            offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            ds = tl.load(
                WS_ptr + offs_n[:, None] * stride_wn + local[None, :],
                mask=mask_n[:, None] & mask_v[None, :],
                other=0.0,
            )
            e = tl.load(
                E_ptr + offs_n[:, None] * stride_en + offs_d[None, :] * stride_ed,
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = tl.dot(tl.trans(ds), e, acc, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                colsum += tl.sum(ds.to(tl.float32), axis=0)
    inv = 1.0 / tl.load(Scale_ptr)
    acc = acc * inv
    colsum = colsum * inv
    tl.store(
        DC_ptr + rows[:, None] * stride_dcv + offs_d[None, :],
        acc.to(DC_ptr.dtype.element_ty),
        mask=mask_v[:, None] & mask_d[None, :],
    )
    if HAS_BIAS:
        if pid_d == 0:
            tl.store(DB_ptr + rows, colsum, mask=mask_v)


def _check_scale(scale):
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError("scale must be a one-element fp32 tensor")


def _launch_dlogits(e, c, bias, targets, lse, coef_a, coef_b, coef_u, threshold, perm, scale, ws, mask, softcap,
                    v_lo, v_hi, filter_e, filter_c, config):
    N, D = e.shape
    V = c.shape[0]
    bn, bv, bd = config.bwd_block_n, config.bwd_block_v, config.bwd_block_d
    dummy = lse
    _dlogits_kernel[(triton.cdiv(N, bn), triton.cdiv(v_hi - v_lo, bv))](
        e, c, bias if bias is not None else dummy, targets, lse, coef_a, coef_b,
        coef_u if coef_u is not None else dummy, threshold if threshold is not None else dummy,
        perm if perm is not None else targets, scale, ws, mask,
        float(softcap) if softcap is not None else 1.0,
        N, V, D, v_lo, v_hi,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1), ws.stride(0), mask.stride(0),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_UNIFORM=coef_u is not None,
        SORTED=perm is not None, FILTER_E=filter_e, FILTER_C=filter_c, DOT_PRECISION=dot_precision(e.dtype),
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages,
    )


def cce_backward_ws(
    e, c, bias, targets, lse, coef_a, coef_b, coef_u, threshold, perm, mu, scale, de, dc, db, ws, mask,
    *, softcap, v_lo, v_hi, filter_e: bool, filter_c: bool, config,
):
    """One vocabulary chunk [v_lo, v_hi) of the workspace backward (three launches).

    scale: [1] fp32 power of two (ws_scale) the workspace holds dz times.
    de: [N, D] fp32, accumulated into. dc: [V, D] gradient (rows of the chunk are written).
    db: [V] fp32 or None (rows of the chunk are written). ws: [N, >= cdiv(v_hi - v_lo, BLOCK_V) * BLOCK_V]
    in e's dtype;
    mask: int8 [cdiv(N, BLOCK_N), >= cdiv(v_hi - v_lo, BLOCK_V)]. Other arguments as cce_backward.
    """
    N, D = e.shape
    if N == 0 or v_hi <= v_lo:
        return
    _check_scale(scale)
    bn, bv, bdo = config.bwd_block_n, config.bwd_block_v, config.ws_block_do
    nv = triton.cdiv(v_hi - v_lo, bv)
    dummy = lse
    prec = dot_precision(e.dtype)
    _launch_dlogits(e, c, bias, targets, lse, coef_a, coef_b, coef_u, threshold, perm, scale, ws, mask, softcap,
                    v_lo, v_hi, filter_e, filter_c, config)
    _ws_de_kernel[(triton.cdiv(N, bn), triton.cdiv(D, bdo))](
        ws, mask, c, perm if perm is not None else targets, mu if mu is not None else dummy, scale, de,
        N, D, v_lo, v_hi, ws.stride(0), mask.stride(0), c.stride(0), c.stride(1), de.stride(0),
        SORTED=perm is not None, CENTER_E=mu is not None, DOT_PRECISION=prec,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_DO=bdo, num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages,
    )
    _ws_dc_kernel[(nv, triton.cdiv(D, bdo))](
        ws, mask, e, perm if perm is not None else targets, scale, dc, db if db is not None else dummy,
        N, D, v_lo, v_hi, ws.stride(0), mask.stride(0), e.stride(0), e.stride(1), dc.stride(0),
        HAS_BIAS=db is not None, SORTED=perm is not None, DOT_PRECISION=prec,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_DO=bdo, num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages,
    )


def ws_scale(coef_a, coef_b, coef_u=None):
    """[1] fp32 power of two 2**-floor(log2(max |coefficient|)), clamped to 2**[-60, 60]; on device,
    no host sync."""
    parts = [coef_a.abs().amax(), coef_b.abs().amax()]
    if coef_u is not None:
        parts.append(coef_u.abs().amax())
    top = torch.stack(parts).amax().float().clamp(2.0**-60, 2.0**60)
    return torch.exp2(-torch.floor(torch.log2(top))).reshape(1)
