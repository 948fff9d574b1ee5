"""Tile-level pieces the CCE kernels share (Triton device functions, inlined where they are called).

For a [BLOCK_N, BLOCK_V] tile of fp32 logits x (token rows offs_n, classifier rows `rows`):

    y  = (x + bias) / temperature                   (activate, given inv_temp = 1 / temperature)
    z  = softcap * tanh(y / softcap)                (activate; z = y without softcap)
    p  = exp(z - lse)                               (probs_tile)
    dz = (A p - B [v == target] - U - H p z) * (1 - tanh^2)   (logit_grad; H with an entropy term)

d loss / d x has the factor 1 / temperature too: the callers' coefficients A, B and U carry it
(ops/common.coefficients), so that logit_grad needs no temperature.

All offsets the callers pass are int64.
"""

import triton
import triton.language as tl

# Below this |y| tanh is evaluated by its odd series: the exp form (1 - t) / (1 + t) cancels there
# (at y = 1e-5 it keeps ~3 correct digits), which made huge softcaps (1e5 .. 1e30, i.e. softcap
# "off") give wrong losses. At the switch the series' first omitted term, 62/2835 y^9, is ~1e-9 of y.
_TANH_SERIES_BELOW = tl.constexpr(0.125)


@triton.jit
def tanh(y):
    # Large |y|: tanh via exp(-2|y|), which never overflows and needs no libdevice (so it runs
    # under TRITON_INTERPRET). Small |y|: y - y^3/3 + 2y^5/15 - 17y^7/315 (Horner in y^2).
    a = tl.abs(y)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    y2 = a * a
    small = a * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    r = tl.where(a < _TANH_SERIES_BELOW, small, big)
    return tl.where(y < 0, -r, r)


@triton.jit
def activate(x, Bias_ptr, rows, mask_v, softcap, inv_temp, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(z, t): z = the logits after bias, temperature and softcap, t = tanh(y / softcap) (0 without
    softcap), y = (x + bias) * inv_temp."""
    if HAS_BIAS:
        x = x + tl.load(Bias_ptr + rows, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    x = x * inv_temp
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
    p, is_t, t, z, offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    """d loss / d x = (A p - B [v == target] - U - H p z), times the softcap's 1 - tanh^2. The
    entropy's part, -h p (z - E[z]) per token, is H = h here and h E[z] inside A."""
    a = tl.load(A_ptr + offs_n, mask=mask_n, other=0.0)
    b = tl.load(B_ptr + offs_n, mask=mask_n, other=0.0)
    dz = a[:, None] * p - tl.where(is_t, b[:, None], 0.0)
    if HAS_UNIFORM:
        dz -= tl.load(U_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    if HAS_ENTROPY:
        dz -= tl.load(H_ptr + offs_n, mask=mask_n, other=0.0)[:, None] * p * z
    if HAS_SOFTCAP:
        dz = dz * (1.0 - t * t)
    return dz
