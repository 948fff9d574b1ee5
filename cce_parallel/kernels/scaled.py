"""x * s, s a one-element tensor on the device (no host sync): into a new tensor of another dtype
(scaled_copy), or in place (scale_), where nothing moves when s is 1.

torch.mul(x, s, out=out) with a 0-dim CUDA s and a narrower out dtype takes PyTorch's generic
casting loop, about twice the time of one read of x and one write of out (measured on an H100:
2.6 ms against 1.2 ms for the V x D fp32 -> bf16 gradient of Gemma 2 2B). scaled_copy is that one
pass. scale_ reads s first and returns at once when it is 1: the usual upstream gradient of a
mean or a sum, known only on the device.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled_copy_kernel(X_ptr, Out_ptr, Scale_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    tl.store(Out_ptr + offs, (x * tl.load(Scale_ptr)).to(Out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(X_ptr, Scale_ptr, numel, BLOCK: tl.constexpr):
    s = tl.load(Scale_ptr)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(X_ptr + offs, mask=mask, other=0.0)
        tl.store(X_ptr + offs, (x * s).to(X_ptr.dtype.element_ty), mask=mask)


def _check(x, scale):
    if not x.is_contiguous() or not x.is_floating_point():
        raise ValueError("x must be a contiguous floating-point tensor")
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device:
        raise ValueError("scale must be a one-element fp32 tensor on x's device")


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place (the product in fp32, rounded once to x's dtype; x untouched where scale
    is 1); returns x."""
    _check(x, scale)
    if x.numel():
        block = 4096 if x.is_cuda else 1024
        _scale_kernel[(triton.cdiv(x.numel(), block),)](x, scale, x.numel(), BLOCK=block, num_warps=8)
    return x


def scaled_copy(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor x * scale in `dtype` (the product in fp32, rounded once)."""
    _check(x, scale)
    out = torch.empty(x.shape, device=x.device, dtype=dtype)
    if x.numel():
        block = 4096 if x.is_cuda else 1024
        grid = (triton.cdiv(x.numel(), block),)
        _scaled_copy_kernel[grid](x, out, scale, x.numel(), BLOCK=block, num_warps=8)
    return out
