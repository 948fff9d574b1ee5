"""The one-pass path's logits GEMM with the softmax weights in its epilogue.

For a block of tokens, X = E_b C^T (+ bias, softcap) never reaches memory: each program computes a
[BLOCK_N, BLOCK_V] tile of fp32 logits z with tl.dot (fp32 accumulation) and stores

    W = exp(z - ref_tile)  (times the softcap's 1 - tanh^2), in the input dtype,

with the tile's sum of exp(z - ref_tile) (from the unrounded values), z at the target and the sum
of z (label smoothing). ref_tile is a multiple of BUCKET log2 units, chosen from the tile's
largest logit so that every W of the tile is below 2^64: ref = 0 for every tile whose largest
logit lies within 44 nats of 0, which is every tile of a real model, so a row's tiles normally
share one reference. Where they do not (huge logits or biases), _rows_kernel brings the row's other
tiles to the row's largest reference by multiplying them by a power of two, which is exact in
bf16 and fp32. Either way W is rounded once, as with the library GEMM and a separate pass, but
the fp32 logits are neither written nor read back: that pass moved 6 bytes per logit.

z at the target must be the GEMM's own: lse - z_t cancels to the loss, which for a confident token
is far smaller than either, so a z_t from a separate dot product (another summation order) puts
the fp32 rounding of z_t itself into the loss. Tried on an H100: the GEMM 2-5 % faster without the
target in its epilogue, but the loss error on confident targets 4.0e-5 against plain bf16
PyTorch's 3.1e-5.

The caller gets W [N, V] and per row ref, sum_v exp(z - ref), z at the target and sum_v z. Once
those are combined over the ranks (an all-reduce between the kernels under tensor parallelism),
_grad_rows_kernel turns them into per-row scalars that make W the logit gradient: one program per
BLOCK_R tokens computes lse, the row's factor w and the target's coefficient, rewrites the target
entry of W where the target is likely, and writes w E (the dC GEMM's operand) rounded once.

The entropy: the GEMM also sums exp(z - ref) z per tile (NEED_PZ), so E[z] comes with the other
statistics. Where the entropy is in the objective (entropy weights h), each entry's gradient is
p (A + h (E[z] - z)), no longer one factor per row: _grad_rows_kernel then rewrites W entry by
entry in one more pass over it (read and written once: on an H200 about 1.3 ms for 2,048 tokens
of Gemma 2's 256,000-row head), z from W itself, and the GEMM leaves the softcap's factor to it.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from cce_parallel.kernels.tiles import activate

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BUCKET = 128.0  # log2 units between references: W of a tile's largest logit lies in [2^-64, 2^64)
_BUCKET = tl.constexpr(BUCKET)
# k of a tile without a finite logit (a bias of -inf masking its rows): below every real one.
EMPTY = -1.0e6
_EMPTY = tl.constexpr(EMPTY)


@triton.jit
def _logits_probs_kernel(
    E,  # [N, D] hidden states: a TMA descriptor of [BLOCK_N, BLOCK_D] blocks if TMA, else a pointer
    C,  # [V, D] classifier rows: a descriptor of [BLOCK_V, BLOCK_D] blocks if TMA, else a pointer
    Bias_ptr,  # [V] bias (dummy unless HAS_BIAS)
    Tgt_ptr,  # [N] targets (any integer dtype): row target - start of this shard
    W,  # [N, V] out, exp(z - ref of the tile) in the input dtype: a descriptor of [BLOCK_N, BLOCK_V]
    #     blocks if TMA, else a pointer (row stride stride_w)
    K_ptr,  # [N, T] fp32 out: each tile's reference in BUCKET log2 units (an integer)
    S_ptr,  # [N, T] fp32 out: each tile's sum of exp(z - ref)
    Zt_ptr,  # [N] fp32: z at the target, written by the tile that holds it (the caller zeroes it)
    Zs_ptr,  # [N, T] fp32 out: each tile's sum of z (dummy unless NEED_ZSUM)
    Pz_ptr,  # [N, T] fp32 out: each tile's sum of exp(z - ref) z (dummy unless NEED_PZ)
    softcap,
    inv_temp,  # 1 / temperature
    start,  # the shard's first vocabulary row
    N,
    V,
    D,
    T,  # vocabulary tiles: cdiv(V, BLOCK_V)
    stride_e,  # row strides of e, c and W (unused with TMA)
    stride_c,
    stride_w,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_ZSUM: tl.constexpr,
    NEED_PZ: tl.constexpr,
    CAP_IN_W: tl.constexpr,  # W carries the softcap's factor (else _grad_rows_kernel applies it)
    TMA: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PROGRAMS: tl.constexpr,  # the grid: each program takes every PROGRAMS-th tile
    GROUP_N: tl.constexpr,  # token tiles that sweep the vocabulary together
):
    # Persistent: the loop over tiles is flattened with the loop over D, so the next tile's loads
    # are in flight during this tile's epilogue. The token tiles go in groups of GROUP_N; within a
    # group, consecutive tiles share a vocabulary tile and run over the group's token tiles: the
    # group's E stays in L2 and each classifier tile is read once per group.
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_n * T, PROGRAMS, flatten=True):
        group = tile // (GROUP_N * T)
        first_n = group * GROUP_N
        rows_g = tl.minimum(tiles_n - first_n, GROUP_N)
        within = tile - group * (GROUP_N * T)
        pid_n = first_n + within % rows_g
        pid_v = within // rows_g
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < N
        mask_v = offs_v < V
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        if TMA:
            # The copy engine zero-fills past the edges of E, C and D.
            for d0 in range(0, D, BLOCK_D):
                a = E.load([pid_n * BLOCK_N, d0])
                b = C.load([pid_v * BLOCK_V, d0])
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        else:
            # Past the edges of E and C, the last row is read instead; those results are never stored.
            e_ptrs = E + tl.minimum(offs_n, N - 1)[:, None] * stride_e + tl.arange(0, BLOCK_D)[None, :]
            c_ptrs = C + tl.minimum(offs_v, V - 1)[None, :] * stride_c + tl.arange(0, BLOCK_D)[:, None]
            for d0 in range(0, D, BLOCK_D):
                if EVEN_D:
                    a = tl.load(e_ptrs)
                    b = tl.load(c_ptrs)
                else:
                    in_d = d0 + tl.arange(0, BLOCK_D) < D
                    a = tl.load(e_ptrs, mask=in_d[None, :], other=0.0)
                    b = tl.load(c_ptrs, mask=in_d[:, None], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                e_ptrs += BLOCK_D
                c_ptrs += BLOCK_D

        z, t = activate(acc, Bias_ptr, offs_v, mask_v, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
        z = z + tl.where(mask_v, 0.0, float("-inf"))[None, :]  # an add: cheaper than a select per entry
        top = tl.max(z, axis=1)
        k = tl.floor((top * LOG2E + 0.5 * _BUCKET) / _BUCKET)
        k = tl.where(top > float("-inf"), k, _EMPTY)
        p = tl.exp2(z * LOG2E - k[:, None] * _BUCKET)  # < 2^64; 0 outside the vocabulary
        s = tl.sum(p, axis=1)
        if NEED_PZ:  # p z, 0 where p is (outside the vocabulary z is -inf)
            pz = tl.sum(p * tl.where(p > 0.0, z, 0.0), axis=1)
        if HAS_SOFTCAP and CAP_IN_W:
            p = p * (1.0 - t * t)
        tile_of_row = offs_n * T + pid_v
        if TMA:
            # The copy engine stores the tile from shared memory, clipped at the edges of W, while
            # the threads go on: no per-element addresses or masks (1-2 % off the GEMM's time on an
            # H200, benchmarks/results/h200_20261126_probes.md).
            W.store([pid_n * BLOCK_N, pid_v * BLOCK_V], p.to(W.dtype))
        else:
            tl.store(W + offs_n[:, None] * stride_w + offs_v[None, :], p.to(W.dtype.element_ty),
                     mask=mask_n[:, None] & mask_v[None, :])
        tl.store(K_ptr + tile_of_row, k, mask=mask_n)
        tl.store(S_ptr + tile_of_row, s, mask=mask_n)
        if NEED_PZ:
            tl.store(Pz_ptr + tile_of_row, pz, mask=mask_n)
        tgt = tl.load(Tgt_ptr + offs_n, mask=mask_n, other=0).to(tl.int64) - start
        here = mask_n & (tgt >= pid_v * BLOCK_V) & (tgt < tl.minimum(pid_v * BLOCK_V + BLOCK_V, V))
        col = tl.where(here, tgt - pid_v * BLOCK_V, -1).to(tl.int32)  # 32-bit compares per entry
        zt = tl.sum(tl.where(tl.arange(0, BLOCK_V)[None, :] == col[:, None], z, 0.0), axis=1)
        tl.store(Zt_ptr + offs_n, zt, mask=here)
        if NEED_ZSUM:
            tl.store(Zs_ptr + tile_of_row, tl.sum(tl.where(mask_v[None, :], z, 0.0), axis=1), mask=mask_n)


@triton.jit
def _down(x, steps):
    """x * 2^(BUCKET * steps) for integer steps <= 0, exactly where the result is an fp32 number: as
    two factors 2^(BUCKET / 2 * steps). One factor of 2^-128 would be subnormal, and the GPU's exp2
    flushes subnormal results to 0: a row's tiles one reference below its largest then vanished
    from its sum and its W (logits past 44 nats in some tiles, below in others: on an H200 row sums
    were 8.7e-4 off in a test, and could lose any share), where the interpreter kept them. The
    products themselves keep subnormals."""
    half = tl.exp2(steps * (_BUCKET / 2))
    return x * half * half


@triton.jit
def _down_rows(W_ptr, rows, low, steps, c0, c1, stride_w, BLOCK: tl.constexpr):
    """W[rows, c0:c1] = _down(W, steps) in place where low (steps [R] <= 0), BLOCK columns a step."""
    for v0 in range(c0, c1, BLOCK):
        cols = v0 + tl.arange(0, BLOCK).to(tl.int64)
        wm = low[:, None] & (cols < c1)[None, :]
        ptrs = W_ptr + rows[:, None] * stride_w + cols[None, :]
        x = tl.load(ptrs, mask=wm, other=0.0).to(tl.float32)
        tl.store(ptrs, _down(x, steps[:, None]).to(W_ptr.dtype.element_ty), mask=wm)


# Not specialized on its sizes: with N, V, T and the row stride all multiples of 16 (a tiny Megatron
# GPT's bf16 loss) triton 3.6 failed to compile it (TritonGPUOptimizeThreadLocality).
@triton.jit(do_not_specialize=["N", "V", "T"])
def _rows_kernel(
    W_ptr,  # [N, V] from _logits_probs_kernel; tiles below their row's reference are rescaled
    K_ptr,  # [N, T] tile references (BUCKET log2 units)
    S_ptr,  # [N, T] tile sums
    Zs_ptr,  # [N, T] tile sums of z (dummy unless NEED_ZSUM)
    Pzt_ptr,  # [N, T] tile sums of exp(z - ref) z (dummy unless NEED_PZ)
    Ref_ptr,  # [N] fp32 out: the row's reference in nats, W = exp(z - ref)
    Sum_ptr,  # [N] fp32 out: sum_v exp(z - ref)
    Zsum_ptr,  # [N] fp32 out: sum_v z (dummy unless NEED_ZSUM)
    Pz_ptr,  # [N] fp32 out: sum_v exp(z - ref) z (dummy unless NEED_PZ)
    N,
    V,
    T,
    stride_w,
    NEED_ZSUM: tl.constexpr,
    NEED_PZ: tl.constexpr,
    TILE_V: tl.constexpr,  # the GEMM's BLOCK_V
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < N
    kmax = tl.full([BLOCK_R], _EMPTY, tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        m = mask_r[:, None] & (tiles < T)[None, :]
        k = tl.load(K_ptr + rows[:, None] * T + tiles[None, :], mask=m, other=_EMPTY)
        kmax = tl.maximum(kmax, tl.max(k, axis=1))
    s = tl.zeros([BLOCK_R], tl.float32)
    zsum = tl.zeros([BLOCK_R], tl.float32)
    pz = tl.zeros([BLOCK_R], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        m = mask_r[:, None] & (tiles < T)[None, :]
        idx = rows[:, None] * T + tiles[None, :]
        k = tl.load(K_ptr + idx, mask=m, other=_EMPTY)
        s += tl.sum(_down(tl.load(S_ptr + idx, mask=m, other=0.0), k - kmax[:, None]), axis=1)
        if NEED_PZ:
            pz += tl.sum(_down(tl.load(Pzt_ptr + idx, mask=m, other=0.0), k - kmax[:, None]), axis=1)
        if NEED_ZSUM:
            zsum += tl.sum(tl.load(Zs_ptr + idx, mask=m, other=0.0), axis=1)
        # Tiles without a finite logit (k = EMPTY) hold zeros and need nothing.
        if tl.max(tl.sum((m & (k > _EMPTY) & (k < kmax[:, None])).to(tl.int32), axis=1), axis=0) > 0:
            # Rare: some row's tile has a lower reference; scale those tiles' W by a power of two.
            for tj in range(t0, tl.minimum(t0 + BLOCK_T, T)):
                kj = tl.load(K_ptr + rows * T + tj, mask=mask_r, other=_EMPTY)
                low = mask_r & (kj > _EMPTY) & (kj < kmax)
                if tl.max(low.to(tl.int32), axis=0) > 0:
                    _down_rows(W_ptr, rows, low, kj - kmax, tj * TILE_V, tl.minimum(tj * TILE_V + TILE_V, V),
                               stride_w, TILE_V)
    ref = tl.where(kmax > _EMPTY, kmax * (_BUCKET / LOG2E), float("-inf"))
    tl.store(Ref_ptr + rows, ref, mask=mask_r)
    tl.store(Sum_ptr + rows, s, mask=mask_r)
    if NEED_ZSUM:
        tl.store(Zsum_ptr + rows, zsum, mask=mask_r)
    if NEED_PZ:
        tl.store(Pz_ptr + rows, pz, mask=mask_r)


def logits_probs(e, c, bias, targets, start, out, zt, *, softcap, need_zsum, config, temperature=1.0, need_pz=False,
                 cap_in_w=True):
    """W = exp(z - ref) (times 1 - tanh^2 with softcap) into out [N, V] (e's dtype, unit column
    stride), z the logits of e [N, D] against c [V, D] (+ bias, divided by `temperature`, then the
    softcap), rows start .. start + V of the vocabulary, and z at each target into zt (fp32 [N],
    zeroed by the caller: rows whose target is not in this shard keep their 0; targets: contiguous
    [N], any integer dtype, as the caller got them, so that this GEMM needs no pass over them first); return (ref, sum_v exp(z - ref),
    sum_v z or None, sum_v exp(z - ref) z or None (need_pz: the entropy's)), fp32 [N]. ref is a
    multiple of BUCKET / log2(e) nats within 44 nats of each row's largest z. cap_in_w=False: W
    leaves out the softcap's factor (grad_rows applies it with the entropy's, from W itself)."""
    n, v = e.shape[0], c.shape[0]
    if out.shape != (n, v) or out.dtype != e.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{n}, {v}] {e.dtype} with unit column stride")
    if e.stride(1) != 1 or c.stride(1) != 1:
        raise ValueError("e and c must have unit column stride")
    if zt.shape != (n,) or zt.dtype != torch.float32 or zt.stride(0) != 1:
        raise ValueError(f"zt must be contiguous fp32 [{n}]")
    if targets.shape != (n,) or targets.stride(0) != 1:
        raise ValueError(f"targets must be contiguous [{n}]")
    f32 = dict(device=e.device, dtype=torch.float32)
    alloc = torch.empty if n and v else torch.zeros
    ref, s = alloc(n, **f32), alloc(n, **f32)
    zsum = alloc(n, **f32) if need_zsum else None
    pz = alloc(n, **f32) if need_pz else None
    if n == 0 or v == 0:
        return ref, s, zsum, pz
    key = (e.device, e.dtype)
    bv, stages = _FITTING.get(key, (config.probs_block_v, config.probs_num_stages))
    while True:
        try:
            tiles, k_t, s_t, zs_t, pz_t = _launch(e, c, bias, targets, start, out, zt, s, softcap, temperature,
                                                  need_zsum, need_pz, cap_in_w, config, bv, stages)
            break
        except OutOfResources:
            bv, stages = _smaller(bv, stages)
            _FITTING[key] = (bv, stages)
    block_r = 16 if e.is_cuda else 128  # the interpreter: few programs
    _rows_kernel[(triton.cdiv(n, block_r),)](
        out, k_t, s_t, zs_t if need_zsum else s_t, pz_t if need_pz else s_t, ref, s, zsum if need_zsum else s,
        pz if need_pz else s, n, v, tiles, out.stride(0),
        NEED_ZSUM=need_zsum, NEED_PZ=need_pz, TILE_V=bv, BLOCK_R=block_r, BLOCK_T=64, num_warps=4,
    )
    return ref, s, zsum, pz


# (device, dtype) -> (block_v, stages) of the fused GEMM, where the configured ones needed more
# shared memory than the GPU has (GPUs other than the H100 / H200 the defaults were tuned on).
_FITTING = {}


def _smaller(block_v: int, stages: int):
    """The next smaller tiling to try: fewer pipeline stages down to 2, then narrower tiles down
    to 32 columns, then 1 stage; OutOfResources again when there is none."""
    if stages > 2:
        return block_v, stages - 1
    if block_v > 32:
        return block_v // 2, stages
    if stages > 1:
        return block_v, stages - 1
    raise OutOfResources(0, 0, "shared memory (no smaller tiling of the fused logits GEMM)")


def _launch(e, c, bias, targets, start, out, zt, dummy, softcap, temperature, need_zsum, need_pz, cap_in_w, config, bv,
            stages):
    """One launch of _logits_probs_kernel with block_v = bv; returns (tiles, k_t, s_t, zs_t, pz_t)."""
    n, d = e.shape
    v = c.shape[0]
    bn, bd = config.probs_block_n, config.probs_block_d
    tiles = triton.cdiv(v, bv)
    f32 = dict(device=e.device, dtype=torch.float32)
    k_t, s_t = torch.empty((n, tiles), **f32), torch.empty((n, tiles), **f32)
    zs_t = torch.empty((n, tiles), **f32) if need_zsum else None
    pz_t = torch.empty((n, tiles), **f32) if need_pz else None
    tma = _tma_usable(e, c, out)
    if tma:
        e_in, c_in = TensorDescriptor.from_tensor(e, [bn, bd]), TensorDescriptor.from_tensor(c, [bv, bd])
        w_out = TensorDescriptor.from_tensor(out, [bn, bv])
    else:
        e_in, c_in, w_out = e, c, out
    programs = min(triton.cdiv(n, bn) * tiles, config.probs_programs)
    _logits_probs_kernel[(programs,)](
        e_in, c_in, bias if bias is not None else dummy, targets, w_out, k_t, s_t, zt, zs_t if need_zsum else dummy,
        pz_t if need_pz else dummy, float(softcap) if softcap is not None else 1.0, 1.0 / temperature, start, n, v, d, tiles, e.stride(0),
        c.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, NEED_ZSUM=need_zsum, NEED_PZ=need_pz,
        CAP_IN_W=cap_in_w, TMA=tma,
        EVEN_D=d % bd == 0, PRECISION="ieee", BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, PROGRAMS=programs,
        GROUP_N=16 if e.is_cuda else 2,  # the interpreter's small calls: several groups, a partial last one
        num_warps=config.probs_num_warps, num_stages=stages,
    )
    return tiles, k_t, s_t, zs_t, pz_t


def _tma_usable(*tensors) -> bool:
    """The copy engine (Hopper and later, or the interpreter) takes e, c and W when their base
    addresses, row strides and row lengths are multiples of 16 bytes (one_pass pads W's rows so).
    The row length too: on an H200 (triton 3.6) a descriptor whose row length was not clipped its
    stores at the next multiple of 16 bytes, past the tensor's last column."""
    if tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
        return False
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        and (t.shape[1] * t.element_size()) % 16 == 0
        for t in tensors
    )


@triton.jit
def _grad_rows_kernel(
    W_ptr,  # [k, V] W of the block (row stride stride_w); confident targets' entries rewritten
    Ref_ptr,  # [k] fp32 this rank's reference per row: W = exp(z - ref) (rows below M: see steps)
    M_ptr,  # [k] fp32 the largest reference over the ranks (any value where not finite)
    S_ptr,  # [k] fp32 sum over the whole vocabulary of exp(z - M)
    Zt_ptr,  # [k] fp32 z at the target (0 where no rank holds it)
    G_ptr,  # [k] fp32 per-token weight g (0 at ignored tokens)
    H_ptr,  # [k] fp32 the entropy's per-token weight h (dummy unless HAS_ENTROPY)
    Mu_ptr,  # [k] fp32 E[z] = sum_v p z (dummy unless HAS_ENTROPY)
    Tgt_ptr,  # [k] int64 target row in this shard, outside [0, V) when not here
    Lse_ptr,  # [k] fp32 out: M + log S
    Wr_ptr,  # [k] fp32 out: w, the factor of W's row in the logit gradient
    B_ptr,  # [k] fp32 out: B', the target term left out of W (0 where it went into W)
    E_ptr,  # [k, D] hidden states (row stride stride_e), read when SCALE_E
    We_ptr,  # [k, D] out: w E rounded to its dtype (row stride stride_we), when SCALE_E
    softcap,
    z_loss,
    keep_target,  # 1 - label smoothing
    k,
    V,
    D,
    stride_w,
    stride_e,
    stride_we,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,  # W is rewritten entry by entry (its softcap's factor too: see grad_rows)
    SCALE_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per step of the row loops over E and W
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < k
    ref = tl.load(Ref_ptr + rows, mask=mask_r, other=0.0)
    m = tl.load(M_ptr + rows, mask=mask_r, other=0.0)
    s = tl.load(S_ptr + rows, mask=mask_r, other=1.0)
    zt = tl.load(Zt_ptr + rows, mask=mask_r, other=0.0)
    g = tl.load(G_ptr + rows, mask=mask_r, other=0.0)
    tgt = tl.load(Tgt_ptr + rows, mask=mask_r, other=-1)
    # A row without a finite logit anywhere has M = -inf: measured from 0 instead, as _combine does.
    m = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
    lse = m + tl.log(s)
    # Under tensor parallelism a row's reference here may lie whole BUCKETs below M (another rank
    # holds logits 44 nats past this rank's). W's row is then brought to M by that power of two
    # (_down), as _rows_kernel does for tiles: the factor 2^-128 itself is no fp32 number on a GPU,
    # whose exp flushes it to 0, and a w that small would keep only a few bits.
    steps = tl.where(mask_r & (ref > float("-inf")), tl.floor((ref - m) * (LOG2E / _BUCKET) + 0.5), 0.0)
    low = steps < 0.0
    ref0 = ref
    if HAS_ENTROPY:
        ref = tl.where(low, m, ref)  # the rewrite below brings such rows down as it goes
    elif tl.max(low.to(tl.int32), axis=0) > 0:  # rare: a row's logits far past 44 nats on one rank
        _down_rows(W_ptr, rows, low, steps, 0, V, stride_w, BLOCK_D)
        ref = tl.where(low, m, ref)
    a = tl.where(z_loss != 0.0, g * (1.0 + 2.0 * z_loss * lse), g)
    unit = tl.exp(ref - m) / s
    here = (tgt >= 0) & (tgt < V)
    b = g * keep_target
    wt = tl.exp(zt - ref)
    if HAS_SOFTCAP:
        dz = 1.0 - (zt / softcap) * (zt / softcap)  # d z / d x at the target: 1 - tanh^2
        b = b * dz
        wt = wt * dz
    b = tl.where(here, b, 0.0)
    if HAS_ENTROPY:
        # Each entry's gradient is p (A - h (z - E[z])) (times the softcap's factor): no longer one
        # factor per row, so W's entries take it: W <- W (A + h (E[z] - z)), z = ref + log W from
        # W itself (2^-9 of a nat off in bf16, where a bf16 logit is off by 2^-9 of itself), and
        # the row's factor is exp(ref - M) / S.
        h = tl.load(H_ptr + rows, mask=mask_r, other=0.0)
        mu = tl.load(Mu_ptr + rows, mask=mask_r, other=0.0)
        w = unit
        wt = wt * (a + h * (mu - zt))
    else:
        w = a * unit
    # A confident target (p >= 1/2) goes into W: its entry's gradient A p - B' is small beside A p,
    # which W holds rounded (2^-9 of p), so rounding first and subtracting after would lose up to
    # p / (1 - p) of it. The entry becomes exp(z_t - ref) - B' / w from fp32 values, rounded once.
    fold = mask_r & here & (w != 0.0) & (zt - lse >= -0.6931471805599453)
    col = tl.minimum(tl.maximum(tgt, 0), V - 1)
    entry = wt - b / tl.where(fold, w, 1.0)
    if HAS_ENTROPY:
        # Per entry, from log2 W: f = A + h (E[z] - z) = f0 - f1 log2 W, and with softcap z / softcap
        # = c0 + c1 log2 W; W's own factor `half` squared (1, or a bringing down as _down's).
        f0 = a + h * (mu - ref0)
        f1 = h * LN2
        c0 = ref0 / softcap
        c1 = LN2 / softcap
        half = tl.where(low, tl.exp2(steps * (_BUCKET / 2)), 1.0)
        col_here = tl.where(fold, col, -1)
        # The grid's second axis splits the rows' columns (a block's rows alone are too few
        # programs to keep the GPU's memory busy); each split works out the rows' factors itself.
        chunk = tl.cdiv(tl.cdiv(V, BLOCK_D), tl.num_programs(1)) * BLOCK_D
        v_lo = tl.program_id(1) * chunk
        row_ptrs = W_ptr + rows * stride_w
        for v0 in range(v_lo, tl.minimum(v_lo + chunk, V), BLOCK_D):
            cols = v0 + tl.arange(0, BLOCK_D)
            wm = mask_r[:, None] & (cols < V)[None, :]
            ptrs = row_ptrs[:, None] + cols[None, :]
            x = tl.load(ptrs, mask=wm, other=0.0).to(tl.float32)
            lg = tl.log2(tl.where(x > 0.0, x, 1.0))
            f = f0[:, None] - f1[:, None] * lg
            if HAS_SOFTCAP:
                zc = c0[:, None] + c1 * lg
                f = f * (1.0 - zc * zc)
            y = x * half[:, None] * half[:, None] * f
            y = tl.where(cols[None, :] == col_here[:, None], entry[:, None], y)
            tl.store(ptrs, y.to(W_ptr.dtype.element_ty), mask=wm)
    else:
        tl.store(W_ptr + rows * stride_w + col, entry.to(W_ptr.dtype.element_ty), mask=fold)
    if tl.program_id(1) == 0:
        tl.store(Lse_ptr + rows, lse, mask=mask_r)
        tl.store(Wr_ptr + rows, w, mask=mask_r)
        tl.store(B_ptr + rows, tl.where(fold, 0.0, b), mask=mask_r)
        if SCALE_E:
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = mask_r[:, None] & (cols < D)[None, :]
                x = tl.load(E_ptr + rows[:, None] * stride_e + cols[None, :], mask=mask, other=0.0)
                tl.store(We_ptr + rows[:, None] * stride_we + cols[None, :],
                         (x.to(tl.float32) * w[:, None]).to(We_ptr.dtype.element_ty), mask=mask)


def grad_rows(w_mat, ref, m, s, zt, g, targets, lse, w, b, e=None, we=None, *, softcap, z_loss, label_smoothing,
              h=None, mean_z=None):
    """The per-token factors of one block's logit gradient w W - B' [v == target] - U (see
    ops/one_pass.py), from its statistics over the whole vocabulary: M the largest of the
    ranks' references, S = sum exp(z - M), zt, and the weights g. Writes lse = M + log S, w =
    A exp(ref - M) / S and B' (fp32 [k], A and B' for g, z_loss and label smoothing; a row whose
    ref lies whole BUCKETs below M has its W brought to M first, and ref = M); where the target is
    in this shard and p >= 1/2, W's target entry becomes exp(z_t - ref) - B' / w and B' = 0. With
    e [k, D], also we = w e rounded to we's dtype (dC's GEMM operand). One launch: about 20 PyTorch
    ops per block before, whose host time left the GPU idle on small heads.

    h, mean_z (fp32 [k]): the entropy's weight per token and E[z]: each entry of W is multiplied
    by A + h (E[z] - z) (and by the softcap's 1 - tanh^2: W must come without it,
    logits_probs(cap_in_w=False)), z from W itself, and w = exp(ref - M) / S."""
    k, v = w_mat.shape
    named = (("ref", ref), ("m", m), ("s", s), ("zt", zt), ("g", g), ("lse", lse), ("w", w), ("b", b))
    entropy = h is not None
    if entropy:
        named += (("h", h), ("mean_z", mean_z))
    for name, t in named:
        if t.shape != (k,) or t.dtype != torch.float32 or t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous fp32 [{k}]")
    if targets.shape != (k,) or w_mat.stride(1) != 1:
        raise ValueError(f"targets must be [{k}] and w_mat have unit column stride")
    scale_e = e is not None
    if scale_e and (e.shape != we.shape or e.shape[0] != k or e.stride(1) != 1 or we.stride(1) != 1):
        raise ValueError(f"e and we must be [{k}, D] with unit column stride")
    if k == 0:
        return
    d = e.shape[1] if scale_e else 0
    # The interpreter (CPU) runs programs one by one: few large ones.
    block_r, block_d = (16, 512) if w_mat.is_cuda else (64, 128)
    programs = triton.cdiv(k, block_r)
    splits = 1
    if entropy and w_mat.is_cuda:  # about eight programs per SM for the rewrite of W
        sms = torch.cuda.get_device_properties(w_mat.device).multi_processor_count
        splits = max(1, min(triton.cdiv(v, block_d), triton.cdiv(8 * sms, programs)))
    _grad_rows_kernel[(programs, splits)](
        w_mat, ref, m, s, zt, g, h if entropy else g, mean_z if entropy else g, targets, lse, w, b,
        e if scale_e else w, we if scale_e else w,
        float(softcap) if softcap is not None else 1.0, float(z_loss), 1.0 - float(label_smoothing), k, v, d,
        w_mat.stride(0), e.stride(0) if scale_e else 0, we.stride(0) if scale_e else 0,
        HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=entropy, SCALE_E=scale_e, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )
