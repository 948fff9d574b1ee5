"""tests/interpreter.py: nested @triton.jit helpers skip triton.language's swap, results unchanged, and
triton.language is itself again once a launch ends."""

import pytest
import torch

from tests.helpers import gpu_run

if gpu_run():
    pytest.skip("the Triton interpreter runs on CPU only", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _four_times_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _twice(_twice(x)) + tl.sum(x, axis=0) * 0, mask=offs < n)


def test_nested_helpers_skip_the_swap_and_the_launch_restores_it():
    from triton.runtime import interpreter

    from tests.interpreter import skip_nested_patching

    if not skip_nested_patching():  # conftest installed it where it could; installing again is a no-op
        pytest.skip("this triton's interpreter has no _patch_lang / _LangPatchScope to skip")
    assert interpreter._patch_lang.skips_nested
    builtin_sum, builtin_load = tl.sum, tl.load
    x = torch.arange(5, dtype=torch.float32)
    out = torch.empty_like(x)
    for _ in range(2):  # the second launch swaps again: the first one's end cleared what it had swapped
        _four_times_kernel[(1,)](x, out, 5, BLOCK=8)
        assert torch.equal(out, 4 * x)
        assert tl.sum is builtin_sum and tl.load is builtin_load  # restored when the launch ended
