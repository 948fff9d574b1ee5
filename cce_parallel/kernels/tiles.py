"""Tile-level pieces the CCE kernels share (Triton device functions, inlined where they are called).

Notation as in backward.py: for a [BLOCK_N, BLOCK_V] tile of token rows offs_n and classifier
rows `rows`,

    x  = E[offs_n] . C[rows]^T                      (logit_tile, fp32 accumulation)
    z  = softcap * tanh((x + bias) / softcap)       (activate; z = x + bias without softcap)
    p  = exp(z - lse)                               (probs_tile)
    dz = (A p - B [v == target] - U) * (1 - tanh^2) (logit_grad)

All offsets the callers pass are int64.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def tanh(y):
    # tanh via exp(-2|y|): never overflows and needs no libdevice (works under TRITON_INTERPRET).
    t = tl.exp(-2.0 * tl.abs(y))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(y < 0, -r, r)


@triton.jit
def logit_tile(
    E_ptr,
    C_ptr,
    offs_n,
    mask_n,
    rows,
    mask_v,
    D,
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """E[offs_n] @ C[rows]^T over D in BLOCK_D steps, fp32 accumulation; masked entries are 0."""
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        mask_d = dd < D
        e = tl.load(
            E_ptr + offs_n[:, None] * stride_en + dd[None, :] * stride_ed,
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        # C is read as a [BLOCK_D, BLOCK_V] tile so the product needs no transpose.
        c = tl.load(
            C_ptr + rows[None, :] * stride_cv + dd[:, None] * stride_cd,
            mask=mask_v[None, :] & mask_d[:, None],
            other=0.0,
        )
        acc = tl.dot(e, c, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def activate(x, Bias_ptr, rows, mask_v, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(z, t): z = the logits after bias and softcap, t = tanh((x + bias) / softcap) (0 without softcap)."""
    if HAS_BIAS:
        x = x + tl.load(Bias_ptr + rows, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        t = tanh(x / softcap)
        z = softcap * t
    else:
        t = tl.zeros_like(x)
        z = x
    return z, t


@triton.jit
def probs_tile(z, Lse_ptr, Tgt_ptr, offs_n, mask_n, rows, mask):
    """(p, is_t): p = exp(z - lse) (0 outside `mask`), is_t marks each row's target column."""
    lse = tl.load(Lse_ptr + offs_n, mask=mask_n, other=0.0)
    p = tl.where(mask, tl.exp(z - lse[:, None]), 0.0)
    tgt = tl.load(Tgt_ptr + offs_n, mask=mask_n, other=-1)
    is_t = (rows[None, :] == tgt[:, None]) & mask
    return p, is_t


@triton.jit
def logit_grad(
    p, is_t, t, offs_n, mask_n, A_ptr, B_ptr, U_ptr, HAS_UNIFORM: tl.constexpr, HAS_SOFTCAP: tl.constexpr
):
    """d loss / d x = (A p - B [v == target] - U), times the softcap's 1 - tanh^2."""
    a = tl.load(A_ptr + offs_n, mask=mask_n, other=0.0)
    b = tl.load(B_ptr + offs_n, mask=mask_n, other=0.0)
    dz = a[:, None] * p - tl.where(is_t, b[:, None], 0.0)
    if HAS_UNIFORM:
        dz -= tl.load(U_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    if HAS_SOFTCAP:
        dz = dz * (1.0 - t * t)
    return dz


@triton.jit
def keep_tile(p, is_t, Thr_ptr, offs_n, mask_n, BY_MAX: tl.constexpr):
    """Whether a tile survives gradient filtering: it holds a target, or some row's probability mass
    in it (its largest probability with BY_MAX) reaches that row's threshold (see backward.py)."""
    thr = tl.load(Thr_ptr + offs_n, mask=mask_n, other=float("inf"))
    if BY_MAX:
        row_p = tl.max(p, axis=1)
    else:
        row_p = tl.sum(p, axis=1)
    big_p = tl.max(row_p - thr, axis=0) >= 0
    has_t = tl.max(tl.max(is_t.to(tl.int32), axis=1), axis=0) > 0
    return big_p | has_t


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use true fp32 products (tf32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"
