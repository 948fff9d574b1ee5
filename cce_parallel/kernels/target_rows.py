"""The target rows' terms of the one-pass gradients: the rows of dC and dE at the batch's targets.

add_rows_summed: out[index[i]] += coef[i] * e[i]. The rows that share an index are summed in fp32
first, so each row of a narrower out (bf16 dC) is rounded once more, not once per row added: a
frequent target token is thousands of rows. Indices outside out's rows (a target another rank
holds, an ignored token) are skipped. Two launches over fixed chunks of the sorted indices: the
first sums each run's rows within a chunk (a 0/1 matrix times the chunk's rows) and adds the runs
that lie within one chunk to out; the second adds up, chunk by chunk, the runs that cross chunk
edges. The order of every sum is fixed: deterministic. The kernel before walked each run from
its start, ~5.5 us per 16 rows on an H100: 0.43 ms for 8,192 targets drawn Zipf-like from Phi 3.5
mini's vocabulary (now 0.15 ms), 2.5 ms on a Llama 3 8B tensor-parallel rank whose tokens' targets
were mostly another rank's, clamped to one row until 2b7d46a (now 0.14 ms); times with the sort,
benchmarks/results/h100_20261125_target_rows.md.

fold_rows: over several token blocks, the batch's target rows of a bf16 dC are summed in fp32
outside it (see ops/one_pass.py).

scale_sub_rows: dE's per-token scale and target term (see its docstring).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_chunk_kernel(
    Out_ptr,  # [V, D] rows to add into (any float dtype), row stride stride_o
    E_ptr,  # [k, D] rows to add, row stride stride_e
    Coef_ptr,  # [k] fp32 factor of each row of e
    Sorted_ptr,  # [k] int32 index, sorted
    Order_ptr,  # [k] int64 the row of e at each sorted position (a stable sort)
    P_ptr,  # [chunks, 2, D] fp32 out: the chunk's sums of the runs that cross its edges
    k,
    V,  # rows of out: other indices are skipped
    D,
    stride_o,
    stride_e,
    CH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One chunk of CH sorted positions, one block of columns: each run's sum within the chunk.
    c = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    pos = c * CH + tl.arange(0, CH)
    inside = pos < k
    idx = tl.load(Sorted_ptr + pos, mask=inside, other=-2)
    valid = inside & (idx >= 0) & (idx < V)
    rows = tl.load(Order_ptr + pos, mask=valid, other=0)
    coef = tl.load(Coef_ptr + rows, mask=valid, other=0.0)
    x = tl.load(E_ptr + rows[:, None] * stride_e + offs_d[None, :], mask=valid[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32) * coef[:, None]
    # Sorted, so a run is a contiguous segment: y[i] = the sum of the rows of i's run in this chunk
    # (0 / 1 weights: exact products, fp32 sums in the dot's fixed order).
    same = (idx[:, None] == idx[None, :]).to(tl.float32)
    y = tl.dot(same, x, input_precision="ieee")
    prev = tl.load(Sorted_ptr + pos - 1, mask=inside & (pos > 0), other=-3)
    first = valid & ((pos == c * CH) | (prev != idx))  # the first position of its segment here
    last_idx = tl.load(Sorted_ptr + tl.minimum(c * CH + CH, k) - 1)
    after = tl.load(Sorted_ptr + c * CH + CH, mask=c * CH + CH < k, other=-3)
    before = tl.load(Sorted_ptr + c * CH - 1, mask=c > 0, other=-3)
    started = (pos == c * CH) & (before == idx)  # the run began in an earlier chunk
    goes_on = (idx == last_idx) & (after == idx)  # the run goes on into the next chunk
    # A run that began earlier leaves its part here in slot 0; one that begins here and goes on, in
    # slot 1 (_rows_span_kernel sums those); a run that lies within the chunk goes into out.
    slot = tl.where(started, 0, 1)
    keep = first & (started | goes_on)
    tl.store(P_ptr + (c * 2 + slot)[:, None] * D + offs_d[None, :], y, mask=keep[:, None] & mask_d[None, :])
    whole = first & ~started & ~goes_on
    ptrs = Out_ptr + idx.to(tl.int64)[:, None] * stride_o + offs_d[None, :]
    m = whole[:, None] & mask_d[None, :]
    out = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(ptrs, (out + y).to(Out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rows_span_kernel(
    Out_ptr,  # [V, D], row stride stride_o
    Sorted_ptr,  # [k] int32 index, sorted
    P_ptr,  # [chunks, 2, D] fp32 from _rows_chunk_kernel
    k,
    V,
    D,
    stride_o,
    CH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The run that begins in chunk c and goes on past it (at most one): its parts, chunk by chunk.
    c = tl.program_id(0).to(tl.int64)
    end = tl.minimum(c * CH + CH, k)
    v = tl.load(Sorted_ptr + end - 1)
    after = tl.load(Sorted_ptr + end, mask=end < k, other=-3)
    head = tl.load(Sorted_ptr + c * CH)
    before = tl.load(Sorted_ptr + c * CH - 1, mask=c > 0, other=-3)
    if (after == v) & ~((head == v) & (before == v)) & (v >= 0) & (v < V):
        offs_d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.load(P_ptr + (c * 2 + 1) * D + offs_d, mask=mask_d, other=0.0)
        nxt = c + 1
        more = nxt >= 0
        while more:
            acc += tl.load(P_ptr + (nxt * 2) * D + offs_d, mask=mask_d, other=0.0)
            stop = nxt * CH + CH
            more = (stop < k) & (tl.load(Sorted_ptr + stop, mask=stop < k, other=-3) == v)
            nxt += 1
        ptrs = Out_ptr + v.to(tl.int64) * stride_o + offs_d
        out = tl.load(ptrs, mask=mask_d, other=0.0).to(tl.float32)
        tl.store(ptrs, (out + acc).to(Out_ptr.dtype.element_ty), mask=mask_d)


def add_rows_summed(out: torch.Tensor, index: torch.Tensor, e: torch.Tensor, coef: torch.Tensor) -> None:
    """out[index[i]] += coef[i] * e[i] for every index[i] in [0, out.shape[0]) (the others are
    skipped), the rows that share an index summed in fp32 and added to out with one rounding. out
    and e: unit column stride, e.shape[1] columns; coef fp32 [k]; index any integer dtype, within
    int32. Deterministic; no host sync."""
    k = index.numel()
    if e.shape != (k, out.shape[1]) or coef.shape != (k,) or coef.dtype != torch.float32:
        raise ValueError(f"e must be [{k}, {out.shape[1]}] and coef fp32 [{k}]")
    if out.stride(1) != 1 or e.stride(1) != 1:
        raise ValueError("out and e must have unit column stride")
    d = out.shape[1]
    if k == 0 or d == 0:
        return
    # int32 keys: half the radix passes of int64 (V < 2^31; skipped indices such as -1 stay outside).
    ordered, order = torch.sort(index.to(torch.int32), stable=True)
    # Chunks of 16 positions, 256 columns: on an H100 the fastest of 16-128 positions, 128-256 columns
    # and an fp32 or 3xTF32 dot (benchmarks/results/h100_20261125_target_rows.md). The interpreter
    # (CPU) runs its programs one by one in numpy: 64 positions, 64 columns (a tiny recipe's step
    # took twice as long with 16 and 32).
    ch, block_d, warps = (16, 256, 4) if out.is_cuda else (64, 64, 1)
    chunks = triton.cdiv(k, ch)
    parts = torch.empty((chunks, 2, d), device=out.device, dtype=torch.float32)
    grid = (chunks, triton.cdiv(d, block_d))
    _rows_chunk_kernel[grid](
        out, e, coef, ordered, order, parts, k, out.shape[0], d, out.stride(0), e.stride(0), CH=ch,
        BLOCK_D=block_d, num_warps=warps,
    )
    _rows_span_kernel[grid](
        out, ordered, parts, k, out.shape[0], d, out.stride(0), CH=ch, BLOCK_D=block_d, num_warps=warps,
    )


@triton.jit
def _fold_rows_kernel(
    Out_ptr,  # [V, D] (bf16 dC), row stride stride_o
    Acc_ptr,  # [S, D] fp32, row stride stride_a
    Rows_ptr,  # [S] int64 row of out for each row of acc, < 0 for none
    D,
    stride_o,
    stride_a,
    BACK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows_ptr + slot)
    if row >= 0:
        offs = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        out_ptrs = Out_ptr + row * stride_o + offs
        acc_ptrs = Acc_ptr + slot * stride_a + offs
        x = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + tl.load(acc_ptrs, mask=mask, other=0.0)
        if BACK:
            tl.store(out_ptrs, x.to(Out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(acc_ptrs, x, mask=mask)
            tl.store(out_ptrs, tl.zeros_like(x).to(Out_ptr.dtype.element_ty), mask=mask)


def fold_rows(out: torch.Tensor, acc: torch.Tensor, rows: torch.Tensor, *, back: bool) -> None:
    """For every i with rows[i] >= 0: acc[i] += out[rows[i]] and out[rows[i]] = 0 (back=False), or
    out[rows[i]] = acc[i] + out[rows[i]], rounded once to out's dtype (back=True). acc fp32 [S, D],
    rows int64 [S] (distinct where >= 0), out [V, D]; unit column strides. No host sync."""
    s, d = acc.shape
    if acc.dtype != torch.float32 or rows.shape != (s,) or out.shape[1] != d:
        raise ValueError(f"acc must be fp32 [{s}, {out.shape[1]}] and rows [{s}]")
    if out.stride(1) != 1 or acc.stride(1) != 1:
        raise ValueError("out and acc must have unit column stride")
    if s == 0 or d == 0:
        return
    block_d = 1024 if out.is_cuda else 128
    _fold_rows_kernel[(s, triton.cdiv(d, block_d))](
        out, acc, rows, d, out.stride(0), acc.stride(0), BACK=back, BLOCK_D=block_d, num_warps=4,
    )


@triton.jit
def _scale_sub_rows_kernel(
    X_ptr,  # [k, D] fp32, row stride stride_x
    Out_ptr,  # [k, D] out (X_ptr itself, or a narrower dtype), row stride stride_o
    W_ptr,  # [k] fp32
    B_ptr,  # [k] fp32
    C_ptr,  # [V, D] rows to subtract (any float dtype), row stride stride_c
    Index_ptr,  # [k] int64 row of c, clamped to [0, V) (rows outside have b = 0)
    k,
    V,
    D,
    stride_x,
    stride_o,
    stride_c,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = rows < k
    mask = mask_r[:, None] & (cols < D)[None, :]
    w = tl.load(W_ptr + rows, mask=mask_r, other=0.0)
    b = tl.load(B_ptr + rows, mask=mask_r, other=0.0)
    idx = tl.minimum(tl.maximum(tl.load(Index_ptr + rows, mask=mask_r, other=0), 0), V - 1)
    x = tl.load(X_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    c = tl.load(C_ptr + idx[:, None] * stride_c + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * w[:, None] - b[:, None] * c
    tl.store(Out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(Out_ptr.dtype.element_ty), mask=mask)


def scale_sub_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, c: torch.Tensor, index: torch.Tensor,
                   out=None):
    """out[i] = w[i] * x[i] - b[i] * c[index[i]] (x fp32 [k, D], w and b fp32 [k], index clamped to
    [0, c.shape[0]), so that a target another shard holds, with b = 0, reads a row of c but
    subtracts nothing), in fp32, rounded once to out's dtype; out [k, D] (unit column stride) must
    not overlap x unless it is x (None: in place). dE's scaling and target term in one pass, where
    PyTorch's mul_, index_select and addcmul_ took three (0.25 ms of Phi 3.5 mini's 7.4 ms on an
    H100). No host sync."""
    k, d = x.shape
    out = x if out is None else out
    if x.dtype != torch.float32 or x.stride(1) != 1 or c.stride(1) != 1 or c.shape[1] != d:
        raise ValueError(f"x must be fp32 [{k}, {d}] and c [V, {d}], both with unit column stride")
    if out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be [{k}, {d}] with unit column stride")
    if w.shape != (k,) or b.shape != (k,) or index.shape != (k,):
        raise ValueError(f"w, b and index must have shape ({k},)")
    if k == 0 or d == 0:
        return
    # The interpreter (CPU) runs programs one by one: few large ones.
    block_k, block_d = (16, 256) if x.is_cuda else (64, 128)
    grid = (triton.cdiv(k, block_k), triton.cdiv(d, block_d))
    _scale_sub_rows_kernel[grid](
        x, out, w, b, c, index, k, c.shape[0], d, x.stride(0), out.stride(0), c.stride(0), BLOCK_K=block_k,
        BLOCK_D=block_d, num_warps=4,
    )
