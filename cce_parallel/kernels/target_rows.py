"""The target rows' terms of the one-pass gradients, each in one pass over the rows it touches.

add_rows_summed: out[index[i]] += coef[i] * e[i]. The rows that share an index are summed in fp32
first, so each row of a narrower out (bf16 dC) is rounded once more, not once per row added: a
frequent target token is thousands of rows. A program per (position in index order, column block);
the one at the start of a run of equal indices walks the run, the others return. Indices outside
out's rows (a target another rank holds, an ignored token) are skipped, never walked: a run is
walked at about 5.5 us per 16 rows on an H100, and on a tensor-parallel rank that holds few of the
targets the others made one run of most of the tokens (2.6 ms of a 26 ms call on 2x H100). The order
of every sum is fixed: deterministic. Traffic: e once and the touched rows of out, where PyTorch's
index_put_ over fp32 [k, D] temporaries moved about 25 times e's bytes (0.45 ms of Phi 3.5 mini's
9 ms loss on an H100).

fold_rows: over several token blocks, the batch's target rows of a bf16 dC are summed in fp32
outside it (see ops/autograd.py, one_pass).

scale_sub_rows: dE's per-token scale and target term (see its docstring).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rows_summed_kernel(
    Out_ptr,  # [V, D] rows to add into (any float dtype), row stride stride_o
    E_ptr,  # [k, D] rows to add, row stride stride_e
    Coef_ptr,  # [k] fp32 factor of each row of e
    Sorted_ptr,  # [k] int32 index, sorted
    Order_ptr,  # [k] int64 the row of e at each sorted position (a stable sort)
    k,
    V,  # rows of out: other indices are skipped
    D,
    stride_o,
    stride_e,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64)
    col = tl.load(Sorted_ptr + pos).to(tl.int64)  # offsets past 2^31: V x D may be
    prev = tl.load(Sorted_ptr + tl.maximum(pos - 1, 0))
    # This position starts its run of equal indices, and the run is one of out's rows.
    if ((pos == 0) | (prev != col)) & (col >= 0) & (col < V):
        offs_d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        start = pos
        more = pos >= 0
        while more:
            at = start + tl.arange(0, ROWS)
            idx = tl.load(Sorted_ptr + at, mask=at < k, other=-1)
            run = idx == col
            rows = tl.load(Order_ptr + at, mask=run, other=0)
            coef = tl.load(Coef_ptr + rows, mask=run, other=0.0)
            x = tl.load(E_ptr + rows[:, None] * stride_e + offs_d[None, :],
                        mask=run[:, None] & mask_d[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32) * coef[:, None], axis=0)
            # The run goes on past this chunk only if its last position still holds col.
            more = tl.sum(run.to(tl.int32), axis=0) == ROWS
            start += ROWS
        ptrs = Out_ptr + col * stride_o + offs_d
        out = tl.load(ptrs, mask=mask_d, other=0.0).to(tl.float32)
        tl.store(ptrs, (out + acc).to(Out_ptr.dtype.element_ty), mask=mask_d)


def add_rows_summed(out: torch.Tensor, index: torch.Tensor, e: torch.Tensor, coef: torch.Tensor) -> None:
    """out[index[i]] += coef[i] * e[i] for every index[i] in [0, out.shape[0]) (the others are
    skipped), the rows that share an index summed in fp32 and added to out with one rounding. out
    and e: unit column stride, e.shape[1] columns; coef fp32 [k]; index any integer dtype, within
    int32. No host sync."""
    k = index.numel()
    if e.shape != (k, out.shape[1]) or coef.shape != (k,) or coef.dtype != torch.float32:
        raise ValueError(f"e must be [{k}, {out.shape[1]}] and coef fp32 [{k}]")
    if out.stride(1) != 1 or e.stride(1) != 1:
        raise ValueError("out and e must have unit column stride")
    if k == 0 or out.shape[1] == 0:
        return
    # int32 keys: half the radix passes of int64 (V < 2^31; skipped indices such as -1 stay outside).
    ordered, order = torch.sort(index.to(torch.int32), stable=True)
    # Wide column blocks: most programs find no run to start and return at once.
    block_d = 1024 if out.is_cuda else 32
    grid = (k, triton.cdiv(out.shape[1], block_d))
    _add_rows_summed_kernel[grid](
        out, e, coef, ordered, order, k, out.shape[0], out.shape[1], out.stride(0), e.stride(0),
        ROWS=16 if out.is_cuda else 4, BLOCK_D=block_d, num_warps=8,
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
    X_ptr,  # [k, D] fp32, row stride stride_x, updated in place
    W_ptr,  # [k] fp32
    B_ptr,  # [k] fp32
    C_ptr,  # [V, D] rows to subtract (any float dtype), row stride stride_c
    Index_ptr,  # [k] int64 row of c, clamped to [0, V) (rows outside have b = 0)
    k,
    V,
    D,
    stride_x,
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
    ptrs = X_ptr + rows[:, None] * stride_x + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    c = tl.load(C_ptr + idx[:, None] * stride_c + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, x * w[:, None] - b[:, None] * c, mask=mask)


def scale_sub_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, c: torch.Tensor, index: torch.Tensor):
    """x[i] = w[i] * x[i] - b[i] * c[index[i]] in place (x fp32 [k, D], w and b fp32 [k], index
    clamped to [0, c.shape[0]), so that a target another shard holds, with b = 0, reads a row of
    c but subtracts nothing): dE's scaling and target term in one pass, where PyTorch's mul_,
    index_select and addcmul_ took three (0.25 ms of Phi 3.5 mini's 7.4 ms on an H100). No host
    sync."""
    k, d = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or c.stride(1) != 1 or c.shape[1] != d:
        raise ValueError(f"x must be fp32 [{k}, {d}] and c [V, {d}], both with unit column stride")
    if w.shape != (k,) or b.shape != (k,) or index.shape != (k,):
        raise ValueError(f"w, b and index must have shape ({k},)")
    if k == 0 or d == 0:
        return
    # The interpreter (CPU) runs programs one by one: few large ones.
    block_k, block_d = (16, 256) if x.is_cuda else (64, 128)
    grid = (triton.cdiv(k, block_k), triton.cdiv(d, block_d))
    _scale_sub_rows_kernel[grid](
        x, w, b, c, index, k, c.shape[0], d, x.stride(0), c.stride(0), BLOCK_K=block_k, BLOCK_D=block_d,
        num_warps=4,
    )
