"""Blockwise linear-log-sum-exp: the CCE forward pass (paper Algorithms 1 and 2, fused).

Math, per token row n of E [N, D] against the classifier C [V, D] (a local vocabulary shard under
tensor parallelism):

    x[n, v] = E[n] . C[v] + bias[v]
    z[n, v] = softcap * tanh(x[n, v] / softcap)      (or x itself without softcap)

For each row the kernel produces the statistics a log-sum-exp needs, never the logits:

    max[n]   = max_v z[n, v]
    sumexp[n] = sum_v exp(z[n, v] - max[n])
    zt[n]    = z[n, target[n]]                        (0 where the target is not in this shard)
    zsum[n]  = sum_v z[n, v]                          (only for label smoothing)
    colsum[v] += sum_n z[n, v]                        (only for vocabulary sorting; int64 fixed point)

Grid: (cdiv(N, BLOCK_N), S). Program (i, s) owns rows [i*BLOCK_N, (i+1)*BLOCK_N) and the s-th
contiguous slice of the vocabulary; it walks that slice in BLOCK_V steps, recomputing a
[BLOCK_N, BLOCK_V] logit tile over D in BLOCK_D steps (fp32 accumulation on tensor cores) and folding
it into an online max / rescaled sum. Each program writes its own partials to row s of [S, N]
outputs; the caller combines the S partials (and, under tensor parallelism, the ranks) in plain
PyTorch. No locks and no float atomics, so the forward is deterministic. The only atomic is the
optional column sum that orders the vocabulary for the backward; it is summed in int64 fixed point
(2**-16 units), so that order, and with it the backward's summation order, is reproducible too.

Precision: products accumulate in fp32; all offsets are int64 because N*V and V*D pass 2**31.
"""

import torch
import triton
import triton.language as tl

from cce_parallel.kernels.tiles import activate, dot_precision, logit_tile


@triton.jit
def _lse_forward_kernel(
    E_ptr,  # [N, D] hidden states, read-only
    C_ptr,  # [V, D] classifier rows of this shard, read-only
    Bias_ptr,  # [V] classifier bias (dummy when HAS_BIAS is False)
    Tgt_ptr,  # [N] int64 target row in this shard; anything outside [0, V) means "not here"
    Max_ptr,  # [S, N] fp32 out: per-split max of z
    Sum_ptr,  # [S, N] fp32 out: per-split sum of exp(z - max)
    Zt_ptr,  # [S, N] fp32 out: target logit if the target falls in the split, else 0
    Zsum_ptr,  # [S, N] fp32 out: per-split sum of z (dummy unless NEED_ZSUM)
    Colsum_ptr,  # [V] int64 in/out, 2**16 * column sum, atomically accumulated (dummy unless NEED_COLSUM)
    softcap,
    N,
    V,
    D,
    v_per_split,  # vocabulary columns per split, a multiple of BLOCK_V
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_ZSUM: tl.constexpr,
    NEED_COLSUM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tgt = tl.load(Tgt_ptr + offs_n, mask=mask_n, other=-1)

    m_run = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_run = tl.zeros([BLOCK_N], tl.float32)
    zt_run = tl.zeros([BLOCK_N], tl.float32)
    zsum_run = tl.zeros([BLOCK_N], tl.float32)

    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_hi
        x = logit_tile(
            E_ptr, C_ptr, offs_n, mask_n, offs_v, mask_v, D, stride_en, stride_ed, stride_cv, stride_cd,
            DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D,
        )
        acc, _t = activate(x, Bias_ptr, offs_v, mask_v, softcap, HAS_BIAS, HAS_SOFTCAP)
        z = tl.where(mask_v[None, :], acc, float("-inf"))

        m_new = tl.maximum(m_run, tl.max(z, axis=1))
        # exp(-inf - finite) is 0, so the first block needs no special case.
        s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_run = m_new
        is_t = offs_v[None, :] == tgt[:, None]
        zt_run += tl.sum(tl.where(is_t, z, 0.0), axis=1)
        if NEED_ZSUM:
            zsum_run += tl.sum(tl.where(mask_v[None, :], z, 0.0), axis=1)
        if NEED_COLSUM:
            col = tl.sum(tl.where(mask_n[:, None] & mask_v[None, :], z, 0.0), axis=0)
            # Fixed point: integer addition is associative, so the order the programs arrive in
            # cannot change the sum. NaN counts as 0; the clamp (2**46 per tile) keeps 2**17 token blocks inside int64.
            col = tl.where(col == col, col, 0.0)
            col = tl.minimum(tl.maximum(col, -1.0e9), 1.0e9) * 65536.0
            tl.atomic_add(Colsum_ptr + offs_v, col.to(tl.int64), mask=mask_v)

    out = pid_s * N + offs_n
    tl.store(Max_ptr + out, m_run, mask=mask_n)
    tl.store(Sum_ptr + out, s_run, mask=mask_n)
    tl.store(Zt_ptr + out, zt_run, mask=mask_n)
    if NEED_ZSUM:
        tl.store(Zsum_ptr + out, zsum_run, mask=mask_n)


def lse_forward(
    e: torch.Tensor,
    c: torch.Tensor,
    bias,
    targets: torch.Tensor,
    softcap,
    *,
    need_zsum: bool,
    need_colsum: bool,
    config,
):
    """Launch the forward statistics kernel.

    Args:
        e: [N, D] hidden states. c: [V, D] classifier (shard). bias: [V] or None.
        targets: [N] int64 row index into c, or any value outside [0, V) for "not in this shard".
        softcap: float or None. config: a `KernelConfig` (block sizes, warps, stages, splits).

    Returns:
        (max, sumexp, zt, zsum, colsum): max/sumexp/zt are [S, N] fp32 partials, zsum is [S, N]
        or None, colsum is [V] int64 (2**16 units) or None.
    """
    N, D = e.shape
    V = c.shape[0]
    assert c.shape[1] == D and targets.shape == (N,) and targets.dtype == torch.int64
    bn, bv, bd = config.fwd_block_n, config.fwd_block_v, config.fwd_block_d
    n_blocks = max(1, triton.cdiv(N, bn))
    v_blocks = triton.cdiv(V, bv)
    splits = max(1, min(v_blocks, triton.cdiv(config.fwd_programs, n_blocks)))
    blocks_per_split = triton.cdiv(v_blocks, splits)
    splits = triton.cdiv(v_blocks, blocks_per_split)  # no empty split
    dev = e.device
    f32 = dict(device=dev, dtype=torch.float32)
    mx = torch.empty((splits, N), **f32)
    se = torch.empty((splits, N), **f32)
    zt = torch.empty((splits, N), **f32)
    zsum = torch.empty((splits, N), **f32) if need_zsum else None
    colsum = torch.zeros((V,), device=dev, dtype=torch.int64) if need_colsum else None
    if N == 0:
        return mx, se, zt, zsum, colsum
    dummy = mx
    _lse_forward_kernel[(n_blocks, splits)](
        e,
        c,
        bias if bias is not None else dummy,
        targets,
        mx,
        se,
        zt,
        zsum if zsum is not None else dummy,
        colsum if colsum is not None else dummy,
        float(softcap) if softcap is not None else 1.0,
        N,
        V,
        D,
        blocks_per_split * bv,
        e.stride(0),
        e.stride(1),
        c.stride(0),
        c.stride(1),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        NEED_ZSUM=need_zsum,
        NEED_COLSUM=need_colsum,
        DOT_PRECISION=dot_precision(e.dtype),
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_D=bd,
        num_warps=config.fwd_num_warps,
        num_stages=config.fwd_num_stages,
    )
    return mx, se, zt, zsum, colsum
