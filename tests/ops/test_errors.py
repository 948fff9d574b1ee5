"""Bad inputs raise the exception type listed in docs/api.md, "Errors" (and ops/functional.py), with a
message naming the problem.

Each check runs with impl "torch" and with a Triton impl: the errors must come before any kernel.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cce_parallel import LinearCrossEntropy, linear_cross_entropy

V, D, N = 517, 48, 37
CHECKED_IMPLS = ["torch", "cce"]


def good(device="cpu", dtype=torch.float32):
    return {
        "e": torch.randn(N, D, dtype=dtype, device=device),
        "c": torch.randn(V, D, dtype=dtype, device=device),
        "targets": torch.randint(0, V, (N,), device=device),
        "bias": torch.randn(V, dtype=dtype, device=device),
    }


def call(args, **options):
    return linear_cross_entropy(args["e"], args["c"], args["targets"], bias=args.get("bias"), **options)


def with_targets(*values):
    args = good()
    args["targets"][: len(values)] = torch.tensor(values)
    return args


def replaced(**tensors):
    args = good()
    args.update(tensors)
    return args


@pytest.fixture(params=CHECKED_IMPLS)
def impl(request):
    return request.param


@pytest.mark.parametrize("bad", [600, V, -5, -1])
def test_target_out_of_range_names_the_value(bad, impl):
    with pytest.raises(ValueError, match="target") as info:
        call(with_targets(3, bad), impl=impl)
    assert str(bad) in str(info.value), f"message does not show the offending target {bad}: {info.value}"


def test_ignore_index_is_not_out_of_range(impl):
    args = with_targets(-100, 5, -100)
    assert torch.isfinite(call(args, impl=impl))
    args = with_targets(-1, 5)
    assert torch.isfinite(call(args, impl=impl, ignore_index=-1))


def test_default_ignore_index_rejected_when_another_is_set(impl):
    with pytest.raises(ValueError, match="-100"):
        call(with_targets(-100), impl=impl, ignore_index=-1)


BAD_SHAPES = {
    "targets-length": lambda: replaced(targets=torch.randint(0, V, (N + 1,))),
    "targets-rank": lambda: replaced(targets=torch.randint(0, V, (N, 1))),
    "e-width": lambda: replaced(e=torch.randn(N, D + 1)),
    "c-width": lambda: replaced(c=torch.randn(V, D - 1)),
    "e-3d-targets-flat": lambda: replaced(e=torch.randn(1, N, D)),
}


@pytest.mark.parametrize("make", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_shape_mismatch(make, impl):
    with pytest.raises(ValueError, match="(?i)shape|target|dim|size"):
        call(make(), impl=impl)


@pytest.mark.parametrize("c_shape", [(V,), (1, V, D), (V, D, 1)])
def test_c_not_2d(c_shape, impl):
    with pytest.raises(ValueError, match="(?i)c\\b|2-?d|dim|shape"):
        call(replaced(c=torch.randn(*c_shape)), impl=impl)


@pytest.mark.parametrize("bias_shape", [(V - 1,), (V + 1,), (1, V), (D,)])
def test_bias_wrong_length(bias_shape, impl):
    with pytest.raises(ValueError, match="bias"):
        call(replaced(bias=torch.randn(*bias_shape)), impl=impl)


BAD_OPTIONS = [
    ("impl", "fast", "impl"),
    ("impl", "CCE", "impl"),
    ("reduction", "avg", "reduction"),
    ("reduction", None, "reduction"),
    ("softcap", 0.0, "softcap"),
    ("softcap", -30.0, "softcap"),
    ("softcap", math.inf, "softcap"),
    ("softcap", math.nan, "softcap"),
    ("label_smoothing", -0.1, "label_smoothing"),
    ("label_smoothing", 1.0, "label_smoothing"),
    ("label_smoothing", 1.5, "label_smoothing"),
    ("label_smoothing", math.nan, "label_smoothing"),
    ("z_loss", -1e-4, "z_loss"),
    ("z_loss", math.inf, "z_loss"),
    ("z_loss", math.nan, "z_loss"),
    ("logits_budget", -1, "logits_budget"),
    ("logits_budget", 1.5, "logits_budget"),
    ("logits_budget", "fast", "logits_budget"),
    ("logits_budget", True, "logits_budget"),
    ("loss_scale", 0.0, "loss_scale"),
    ("loss_scale", math.inf, "loss_scale"),
    ("loss_scale", math.nan, "loss_scale"),
    ("loss_scale", True, "loss_scale"),
    ("loss_scale", "0.5", "loss_scale"),
    ("loss_scale", torch.tensor(0.5), "loss_scale"),
]


@pytest.mark.parametrize("name, value, pattern", BAD_OPTIONS, ids=lambda v: repr(v))
def test_bad_option(name, value, pattern, impl):
    options = {"impl": impl, name: value}
    with pytest.raises(ValueError, match=pattern):
        call(good(), **options)


@pytest.mark.parametrize("name, value, pattern", BAD_OPTIONS[:12:3] + BAD_OPTIONS[-6:-3],
                         ids=lambda v: repr(v))
def test_bad_option_in_module(name, value, pattern):
    """The module may check at construction or at forward; either way it raises."""
    args = good()
    with pytest.raises(ValueError, match=pattern):
        LinearCrossEntropy(**{name: value})(args["e"], args["c"], args["targets"])


BAD_DTYPES = {
    "c-bf16": lambda: replaced(c=torch.randn(V, D, dtype=torch.bfloat16)),
    "e-fp16": lambda: replaced(e=torch.randn(N, D, dtype=torch.float16)),
    "bias-bf16": lambda: replaced(bias=torch.randn(V, dtype=torch.bfloat16)),
    "e-c-int": lambda: replaced(
        e=torch.ones(N, D, dtype=torch.int32), c=torch.ones(V, D, dtype=torch.int32), bias=None
    ),
    "targets-float": lambda: replaced(targets=torch.randint(0, V, (N,)).float()),
}


@pytest.mark.parametrize("make", BAD_DTYPES.values(), ids=BAD_DTYPES.keys())
def test_bad_dtype(make, impl):
    with pytest.raises(TypeError, match="(?i)dtype|float|integer|int"):
        call(make(), impl=impl)


@pytest.mark.parametrize("which", ["e", "c"])
def test_meta_vs_cpu_device(which, impl):
    args = good()
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match="device"):
        call(args, impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["c", "targets", "bias"])
def test_mixed_cuda_cpu_devices(which, impl, cuda):
    args = good(cuda)
    args[which] = args[which].cpu()
    with pytest.raises(ValueError, match="device"):
        call(args, impl=impl)


@pytest.mark.parametrize("late", [True, pytest.param(False, marks=pytest.mark.interpreter)])
def test_triton_interpret_set_after_triton_names_the_cause(late):
    """TRITON_INTERPRET=1 set after triton's import (megatron.core imports triton) left triton's own
    functions compiled: the kernels failed with "Cannot call @triton.jit'd outside of the scope of
    a kernel". The loss now says why; set in time, the same script runs."""
    order = "import triton, os; os.environ['TRITON_INTERPRET'] = '1'" if late else \
        "import os; os.environ['TRITON_INTERPRET'] = '1'; import triton"
    script = (f"{order}\nimport torch, cce_parallel\n"
              "e = torch.randn(8, 16, requires_grad=True); c = torch.randn(32, 16, requires_grad=True)\n"
              "cce_parallel.linear_cross_entropy(e, c, torch.randint(0, 32, (8,))).backward()\nprint('ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    if late:
        assert out.returncode != 0 and "was set after triton was imported" in out.stderr, out.stderr[-2000:]
    else:
        assert out.returncode == 0 and "ran" in out.stdout, out.stderr[-2000:]
