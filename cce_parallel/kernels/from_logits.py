"""CCE statistics and logit gradients from fp32 logits that a library GEMM wrote.

The caller computes logits with a library GEMM that accumulates and writes fp32,
X = E[tokens] @ C[v_lo:v_hi]^T, into a buffer of bounded size (never the whole [N, V] unless it fits
the budget); these kernels then make one pass over it:

  _stats_from_logits_kernel, grid (cdiv(N, BLOCK_N), slices): for each row, over a slice of the
      chunk's columns, z = softcap * tanh(y / softcap) (or y), y = (x + bias) / temperature, and the partials
      max, sumexp (relative to that max), zt (the target's z if the target is in the slice) and
      zsum; written to row `split + slice` of [S, N] outputs, which ops/lean.py folds.
  _dz_from_logits_kernel, grid (cdiv(N, BLOCK_N), cdiv(Vc, BLOCK_V)): the loss gradient w.r.t. the
      logits, dz = A p - B [v == target] - U (times the softcap's 1 - tanh^2), p = exp(z - lse),
      written in the input dtype to a separate workspace (the two-pass "lean" backward).
  _dz_rows_kernel, grid (cdiv(N, BLOCK_N),): the same dz, written IN PLACE over the fp32 logits
      (the one-pass path's variant for fp16, and for softcap with label smoothing): row n's
      gradient, in the gradient dtype, takes the first bytes of row n's own logits, so the buffer
      serves as both and the GEMMs read dz with row stride stride_xn * 4 / itemsize. Each program walks its rows left to right, so a store only
      overwrites logits that this program has already read (see the kernel for why that holds).

The one-pass path's usual case (bf16 and fp32) needs none of these: kernels/probs_gemm.py computes
its logits and softmax weights in one GEMM. The passes here read 4 bytes per logit. Precision:
products accumulate in fp32 and z is never rounded before exp. Offsets are int64 (N * V passes 2**31 for large buffers).
"""

import torch
import triton
import triton.language as tl

from cce_parallel.kernels.tiles import activate, logit_grad, probs_tile


@triton.jit
def _stats_from_logits_kernel(
    X_ptr,  # [N, Vc] fp32 logits of the chunk (without bias), read-only
    Bias_ptr,  # [V] bias (dummy unless HAS_BIAS)
    Tgt_ptr,  # [N] int64 target row in this shard, outside [0, V) when not here
    Max_ptr,  # [S, N] fp32 out: row `split`
    Sum_ptr,  # [S, N] fp32 out: sum exp(z - max)
    Zt_ptr,  # [S, N] fp32 out: z at the target (0 if not in the chunk)
    Zsum_ptr,  # [S, N] fp32 out: sum of z (dummy unless NEED_ZSUM)
    Pz_ptr,  # [S, N] fp32 out: sum exp(z - max) z (dummy unless NEED_PZ)
    softcap,
    inv_temp,
    split,
    N,
    v_lo,
    v_hi,
    cols_per_prog,
    stride_xn,
    stride_s,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_ZSUM: tl.constexpr,
    NEED_PZ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)  # which slice of the chunk's columns
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tgt = tl.load(Tgt_ptr + offs_n, mask=mask_n, other=-1)
    m_run = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_run = tl.zeros([BLOCK_N], tl.float32)
    zt_run = tl.zeros([BLOCK_N], tl.float32)
    zsum_run = tl.zeros([BLOCK_N], tl.float32)
    pz_run = tl.zeros([BLOCK_N], tl.float32)
    c_lo = pid_c * cols_per_prog
    c_hi = tl.minimum(c_lo + cols_per_prog, v_hi - v_lo)
    for k0 in range(c_lo, c_hi, BLOCK_V):
        local = k0 + tl.arange(0, BLOCK_V).to(tl.int64)
        rows = v_lo + local
        mask_v = local < c_hi
        m = mask_n[:, None] & mask_v[None, :]
        z = tl.load(X_ptr + offs_n[:, None] * stride_xn + local[None, :], mask=m, other=0.0)
        z, _t = activate(z, Bias_ptr, rows, mask_v, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
        z = tl.where(mask_v[None, :], z, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(z, axis=1))
        # A row that is all -inf so far keeps m = -inf: shift by 0 then, not by -inf (NaN).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m_run - shift)
        q = tl.exp(z - shift[:, None])
        s_run = s_run * rescale + tl.sum(q, axis=1)
        if NEED_PZ:  # z is -inf outside the slice, where q is 0
            pz_run = pz_run * rescale + tl.sum(q * tl.where(mask_v[None, :], z, 0.0), axis=1)
        m_run = m_new
        # Columns past this slice's end belong to the next slice: they must not match the target.
        is_t = (rows[None, :] == tgt[:, None]) & mask_v[None, :]
        zt_run += tl.sum(tl.where(is_t, z, 0.0), axis=1)
        if NEED_ZSUM:
            zsum_run += tl.sum(tl.where(mask_v[None, :], z, 0.0), axis=1)
    out = (split + pid_c) * stride_s + offs_n
    tl.store(Max_ptr + out, m_run, mask=mask_n)
    tl.store(Sum_ptr + out, s_run, mask=mask_n)
    tl.store(Zt_ptr + out, zt_run, mask=mask_n)
    if NEED_ZSUM:
        tl.store(Zsum_ptr + out, zsum_run, mask=mask_n)
    if NEED_PZ:
        tl.store(Pz_ptr + out, pz_run, mask=mask_n)


@triton.jit
def _dz_from_logits_kernel(
    X_ptr,  # [N, Vc] fp32 logits of the chunk (without bias), read-only
    Bias_ptr,  # [V] bias (dummy unless HAS_BIAS)
    Tgt_ptr,  # [N] int64 target row in this shard
    Lse_ptr,  # [N] fp32 global log-sum-exp
    A_ptr,  # [N] fp32 coefficient of p
    B_ptr,  # [N] fp32 coefficient of the one-hot target
    U_ptr,  # [N] fp32 uniform coefficient (dummy unless HAS_UNIFORM)
    H_ptr,  # [N] fp32 coefficient of p z, the entropy's (dummy unless HAS_ENTROPY)
    Scale_ptr,  # [1] fp32 power of two the workspace is scaled by
    WS_ptr,  # [N, Vc] out: scale * dz, input dtype
    softcap,
    inv_temp,
    N,
    v_lo,
    v_hi,
    stride_xn,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = v_lo + local
    mask_v = rows < v_hi
    m = mask_n[:, None] & mask_v[None, :]
    z = tl.load(X_ptr + offs_n[:, None] * stride_xn + local[None, :], mask=m, other=0.0)
    z, t = activate(z, Bias_ptr, rows, mask_v, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
    p, is_t = probs_tile(z, Lse_ptr, Tgt_ptr, offs_n, mask_n, rows, m)
    dz = logit_grad(p, is_t, t, z, offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM, HAS_SOFTCAP,
                    HAS_ENTROPY)
    dz = dz * tl.load(Scale_ptr)
    tl.store(WS_ptr + offs_n[:, None] * stride_wn + local[None, :], dz.to(WS_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dz_rows_kernel(
    X_ptr,  # [N, >= V] fp32 logits (without bias); read, then overwritten by dz in G's dtype
    Bias_ptr,  # [V] bias (dummy unless HAS_BIAS)
    Tgt_ptr,  # [N] int64 target row in this shard, outside [0, V) when not here
    Lse_ptr,  # [N] fp32 global log-sum-exp
    A_ptr,  # [N] fp32 coefficient of p
    B_ptr,  # [N] fp32 coefficient of the one-hot target
    U_ptr,  # [N] fp32 uniform coefficient (dummy unless HAS_UNIFORM)
    H_ptr,  # [N] fp32 coefficient of p z, the entropy's (dummy unless HAS_ENTROPY)
    Scale_ptr,  # [1] fp32 power of two dz is scaled by
    softcap,
    inv_temp,
    N,
    V,
    stride_xn,  # row stride of X in fp32 elements; dz row n starts at the same byte
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    G_DTYPE: tl.constexpr,
    G_PER_F32: tl.constexpr,  # elements of G_DTYPE per fp32 element: 1 or 2
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # In place: dz column v of row n is stored at byte 4 * stride_xn * n + size(G_DTYPE) * v. Tile j
    # of a row stores into bytes that hold logits of tiles <= j, never of a later tile. The barrier
    # before each store makes every thread of the program finish reading tile j (and the compiler
    # keep loads above it) before any thread overwrites it, whatever the warps and the vector width.
    # Rows never share bytes, so programs are independent.
    pid = tl.program_id(0).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    g_ptr = X_ptr.to(tl.pointer_type(G_DTYPE), bitcast=True)
    g_row = offs_n * (stride_xn * G_PER_F32)
    scale = tl.load(Scale_ptr)
    for v0 in range(0, V, BLOCK_V):
        rows = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        mask_v = rows < V
        m = mask_n[:, None] & mask_v[None, :]
        x = tl.load(X_ptr + offs_n[:, None] * stride_xn + rows[None, :], mask=m, other=0.0)
        z, t = activate(x, Bias_ptr, rows, mask_v, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
        p, is_t = probs_tile(z, Lse_ptr, Tgt_ptr, offs_n, mask_n, rows, m)
        dz = logit_grad(p, is_t, t, z, offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM, HAS_SOFTCAP,
                        HAS_ENTROPY) * scale
        tl.debug_barrier()
        tl.store(g_ptr + g_row[:, None] + rows[None, :], dz.to(G_DTYPE), mask=m)


# The statistics pass is bound by reading the fp32 chunk: short row blocks give enough programs.
STATS_BLOCK_N = 16
STATS_BLOCK_V = 256


def _stats_blocks(config, on_cuda: bool):
    # Under the interpreter, small blocks; twice the chunk granularity (fwd_block_v), as on the GPU,
    # so that a block can run past the end of a slice or chunk there too.
    if on_cuda:
        return min(STATS_BLOCK_N, config.fwd_block_n), STATS_BLOCK_V
    return config.fwd_block_n, 2 * config.fwd_block_v


def stats_slices(n: int, cols: int, config, on_cuda: bool) -> int:
    """How many column slices (partial splits) a chunk of `cols` columns gets, so that the grid has
    about config.fwd_programs programs when there are few row blocks."""
    bn, bv = _stats_blocks(config, on_cuda)
    n_blocks = max(1, triton.cdiv(n, bn))
    return max(1, min(triton.cdiv(cols, bv), triton.cdiv(config.fwd_programs, n_blocks)))


def stats_from_logits(x, bias, targets, softcap, mx, se, zt, zsum, *, split, slices, v_lo, v_hi, config,
                      temperature=1.0, pz=None):
    """Fold the fp32 logit chunk x [N, >= v_hi - v_lo] (columns = rows v_lo..v_hi of the shard) into
    rows split .. split + slices - 1 of the [S, N] partials mx, se, zt, zsum and pz (zsum, pz may be
    None; pz: sum exp(z - max) z, relative to the same max as se), one row per slice of the chunk's
    columns."""
    N = x.shape[0]
    if N == 0 or v_hi <= v_lo:
        return
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError("x must be fp32 with unit column stride")
    if any(t is not None and (t.stride() != mx.stride() or t.shape != mx.shape) for t in (se, zt, zsum, pz)):
        raise ValueError("mx, se, zt, zsum must share shape and strides")
    if split + slices > mx.shape[0]:
        raise ValueError(f"partials have {mx.shape[0]} rows, need {split + slices}")
    bn, bv = _stats_blocks(config, x.is_cuda)
    cols = v_hi - v_lo
    per = triton.cdiv(triton.cdiv(cols, slices), bv) * bv
    dummy = mx
    _stats_from_logits_kernel[(triton.cdiv(N, bn), slices)](
        x, bias if bias is not None else dummy, targets, mx, se, zt, zsum if zsum is not None else dummy,
        pz if pz is not None else dummy,
        float(softcap) if softcap is not None else 1.0, 1.0 / temperature, split, N, v_lo, v_hi, per, x.stride(0),
        mx.stride(0),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, NEED_ZSUM=zsum is not None,
        NEED_PZ=pz is not None, BLOCK_N=bn, BLOCK_V=bv, num_warps=4,
    )


def dz_from_logits(x, bias, targets, lse, coef_a, coef_b, coef_u, scale, ws, *, softcap, v_lo, v_hi, config,
                   temperature=1.0, coef_h=None):
    """ws[:, :v_hi - v_lo] = scale * d loss / d z for the fp32 logit chunk x (see the module doc);
    coef_h: None, or the per-token coefficient of -p z (an entropy term, tiles.logit_grad)."""
    N = x.shape[0]
    if N == 0 or v_hi <= v_lo:
        return
    if x.dtype != torch.float32 or x.stride(1) != 1 or ws.stride(1) != 1:
        raise ValueError("x must be fp32 and x, ws must have unit column stride")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError("scale must be a one-element fp32 tensor")
    bn, bv = config.bwd_block_n, config.bwd_block_v
    dummy = lse
    _dz_from_logits_kernel[(triton.cdiv(N, bn), triton.cdiv(v_hi - v_lo, bv))](
        x, bias if bias is not None else dummy, targets, lse, coef_a, coef_b,
        coef_u if coef_u is not None else dummy, coef_h if coef_h is not None else dummy, scale, ws,
        float(softcap) if softcap is not None else 1.0,
        1.0 / temperature, N, v_lo, v_hi, x.stride(0), ws.stride(0),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_UNIFORM=coef_u is not None,
        HAS_ENTROPY=coef_h is not None, BLOCK_N=bn, BLOCK_V=bv, num_warps=config.bwd_num_warps,
    )


def dz_rows_in_place(x, bias, targets, lse, coef_a, coef_b, coef_u, scale, grad_dtype, *, softcap, config,
                     temperature=1.0, coef_h=None):
    """Overwrite the fp32 logits x [N, >= V] (columns = rows 0..V-1 of the shard, V = len of the
    targets' shard: x.shape[1] unless the caller passes a narrower view) with scale * d loss / d z
    in grad_dtype, in place, and return that [N, V] view of x's memory (row stride in grad_dtype
    elements: x.stride(0) * 4 / itemsize). coef_h: the entropy's coefficient of p z, or None."""
    N, V = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError("x must be fp32 with unit column stride")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError("scale must be a one-element fp32 tensor")
    ratio = 4 // _itemsize(grad_dtype)
    g = _grad_view(x, grad_dtype)
    if N == 0 or V == 0:
        return g
    dummy = lse
    _dz_rows_kernel[(triton.cdiv(N, config.rows_block_n),)](
        x, bias if bias is not None else dummy, targets, lse, coef_a, coef_b,
        coef_u if coef_u is not None else dummy, coef_h if coef_h is not None else dummy, scale, float(softcap) if softcap is not None else 1.0,
        1.0 / temperature, N, V, x.stride(0),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_UNIFORM=coef_u is not None,
        HAS_ENTROPY=coef_h is not None, G_DTYPE=_TL_DTYPES[grad_dtype], G_PER_F32=ratio, BLOCK_N=config.rows_block_n,
        BLOCK_V=config.rows_block_v,
        num_warps=config.rows_num_warps,
    )
    return g


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _grad_view(x, grad_dtype):
    """x's memory seen as grad_dtype [N, V]: row n starts at the same byte, columns 0..V-1 first."""
    return x if grad_dtype == torch.float32 else x.view(grad_dtype)[:, : x.shape[1]]


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def grad_scale(coef_a, coef_b, coef_u=None):
    """[1] fp32 power of two 2**-floor(log2(max |coefficient|)), clamped to 2**[-60, 60], on device
    (no host sync). fp16 logit gradients are stored times this, so that the small probabilities of a
    large vocabulary stay above fp16's subnormals while the largest stays below its maximum."""
    parts = [coef_a.abs().amax(), coef_b.abs().amax()]
    if coef_u is not None:
        parts.append(coef_u.abs().amax())
    top = torch.stack(parts).amax().float().clamp(2.0**-60, 2.0**60)
    return torch.exp2(-torch.floor(torch.log2(top))).reshape(1)
