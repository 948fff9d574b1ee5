"""x * s on the device (no host sync), s one fp32 number or one per row of x: into a new tensor of
another dtype (scaled_copy), or one number in place (scale_), where nothing moves when s is 1.

torch.mul(x, s, out=out) with a 0-dim CUDA s and a narrower out dtype takes PyTorch's generic
casting loop, about twice the time of one read of x and one write of out (measured on an H100:
2.6 ms against 1.2 ms for the V x D fp32 -> bf16 gradient of Gemma 2 2B). scaled_copy is that one
pass. scale_ reads s first and returns at once when it is 1: the usual upstream gradient of a
mean or a sum, known only on the device. Its programs loop over the blocks, so that this no-op is a
few microseconds even for V x D elements (one program per block took 80 us on Llama 3 8B's dC).
snap_ratio decides, on the device, whether a number is (within a few ulps of) a power of two.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled_copy_kernel(X_ptr, Out_ptr, Scale_ptr, numel, row_len, PER_ROW: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    if PER_ROW:
        s = tl.load(Scale_ptr + offs // row_len, mask=mask, other=0.0)
    else:
        s = tl.load(Scale_ptr)
    tl.store(Out_ptr + offs, (x * s).to(Out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(X_ptr, Scale_ptr, numel, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    s = tl.load(Scale_ptr)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        for _ in range(tl.program_id(0), tl.cdiv(numel, BLOCK), PROGRAMS):
            mask = offs < numel
            x = tl.load(X_ptr + offs, mask=mask, other=0.0)
            tl.store(X_ptr + offs, (x * s).to(X_ptr.dtype.element_ty), mask=mask)
            offs += PROGRAMS * BLOCK


def _check(x, scale, rows_ok: bool):
    if not x.is_contiguous() or not x.is_floating_point():
        raise ValueError("x must be a contiguous floating-point tensor")
    sizes = (1, x.shape[0]) if rows_ok and x.dim() else (1,)
    if scale.numel() not in sizes or scale.dtype != torch.float32 or scale.device != x.device:
        what = "one fp32 number or one per row of x" if rows_ok else "a one-element fp32 tensor"
        raise ValueError(f"scale must be {what}, on x's device")


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place (the product in fp32, rounded once to x's dtype; x untouched where scale
    is 1); returns x."""
    _check(x, scale, rows_ok=False)
    if x.numel():
        block = 4096 if x.is_cuda else 16384  # the interpreter: few, large numpy steps
        programs = min(triton.cdiv(x.numel(), block), 1024 if x.is_cuda else 4)
        _scale_kernel[(programs,)](x, scale, x.numel(), BLOCK=block, PROGRAMS=programs, num_warps=8)
    return x


def scaled_copy(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor x * scale in `dtype` (the product in fp32, rounded once); scale holds
    one number, or one per row of x (x[i] * scale[i])."""
    _check(x, scale, rows_ok=True)
    out = torch.empty(x.shape, device=x.device, dtype=dtype)
    if x.numel():
        block = 4096 if x.is_cuda else 16384
        per_row = scale.numel() > 1
        grid = (triton.cdiv(x.numel(), block),)
        _scaled_copy_kernel[grid](
            x, out, scale, x.numel(), x.numel() // x.shape[0], PER_ROW=per_row, BLOCK=block, num_warps=8
        )
    return out


# Mantissa units (of 2^23) within which a ratio counts as a power of two: 2^-20 relative. The fp32
# quotients of a forward's and a backward's scale differ by an ulp or two; a bf16 gradient scaled
# by a number that close to a power of two rounds as if scaled by the power of two.
SNAP_ULPS = 8


@triton.jit
def _snap_kernel(R_ptr, Weighted_ptr, Out_ptr, Flag_ptr, Report_ptr, HAS_WEIGHTED: tl.constexpr,
                 SNAP: tl.constexpr, ULPS: tl.constexpr):
    r = tl.load(R_ptr)
    bits = r.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    normal = (exponent != 0) & (exponent != 255)
    down = mantissa <= ULPS  # just above a power of two
    up = mantissa >= 0x800000 - ULPS  # just below the next one
    power = (bits & -8388608) + tl.where(up & ~down, 0x800000, 0)  # -8388608: sign and exponent bits
    near = normal & (down | up) & SNAP
    off = (normal & ~near & SNAP).to(tl.int32)
    weighted = tl.load(Weighted_ptr) if HAS_WEIGHTED else 0
    out = tl.where(near, power.to(tl.float32, bitcast=True), r)
    tl.store(Out_ptr, out)
    tl.store(Flag_ptr, (weighted != 0).to(tl.int32) | off)
    tl.store(Report_ptr, (weighted + 4 * off).to(tl.float32))
    tl.store(Report_ptr + 1, out)


def snap_ratio(ratio: torch.Tensor, weighted=None, *, snap: bool = True):
    """One launch, no host sync. ratio: a one-element fp32 tensor; weighted: None or int32 [1],
    0 or a code of the per-token weights (ops/upstream.py: 1 many, 2 mask). Returns (snapped, flag,
    report): snapped (shaped like ratio) the power of two within SNAP_ULPS of ratio if there is
    one, else ratio; flag int32 [1], 1 where weighted is not 0 or off is 1, off being 1 for a normal
    ratio that is not near a power of two (0, subnormals, inf and NaN are not off); report fp32 [2]
    = (weighted + 4 * off, snapped). snap=False: ratio as it is, off 0."""
    if ratio.numel() != 1 or ratio.dtype != torch.float32:
        raise ValueError("ratio must be a one-element fp32 tensor")
    out = torch.empty_like(ratio)
    flag = torch.empty(1, device=ratio.device, dtype=torch.int32)
    report = torch.empty(2, device=ratio.device, dtype=torch.float32)
    _snap_kernel[(1,)](ratio, weighted if weighted is not None else flag, out, flag, report,
                       HAS_WEIGHTED=weighted is not None, SNAP=snap, ULPS=SNAP_ULPS, num_warps=1)
    return out, flag, report
