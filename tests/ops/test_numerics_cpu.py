"""fp32 numerics of every impl against the float64 oracle, at small odd shapes.

On a CPU machine the Triton impls run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which is slow: the Triton impls get a handful of option combinations that
together cover every option, while impl "torch" gets the full product. With CCE_TEST_GPU=1 on a
CUDA machine the same tests run on the GPU with compiled kernels.

Every path is checked: the one-pass path (gradients in the forward) in one token block and in
several, its two-pass variant (softcap with label smoothing), the
backward's three cases (one upstream number, per-token weights, a gradient through lse), and the
lean path (logits_budget="lean"). Tolerances are relative Frobenius errors, as tight as fp32 allows.
"""

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cce_parallel
from cce_parallel import IMPLS, LinearCrossEntropy, linear_cross_entropy
from tests.helpers import (
    assert_errors_below,
    check_against_oracle,
    child_pythonpath,
    errors,
    random_inputs,
    run,
    upstream,
)
from tests.oracle import oracle, plain_torch, rel_err

V, D, N = 517, 48, 37
# The Triton impls compute the same thing, bit for bit (test_triton_impls_agree): the pretraining
# one stands for all; "torch" is the PyTorch path.
TRITON_IMPLS = ("cce_kahan_full_c",)
TESTED_IMPLS = (*TRITON_IMPLS, "torch")
TIGHT = {"loss": 1e-5, "lse": 1e-5, "de": 5e-5, "dc": 5e-5, "dbias": 5e-5}
# logits_budget values that give one token block, blocks of a few tokens, and the lean path.
BUDGETS = {"one-block": "auto", "blocks": 3 * 4 * V, "lean": "lean"}


@pytest.fixture(autouse=True)
def _triton_runs_for_real(request, device):
    """Triton impls on CPU tensors silently fall back to "torch" without the interpreter."""
    impl = request.node.callspec.params.get("impl") if hasattr(request.node, "callspec") else None
    if impl in TRITON_IMPLS and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton impls on CPU need TRITON_INTERPRET=1 (unset CCE_TEST_GPU)")


@dataclasses.dataclass
class Case:
    """Inputs (random_inputs arguments) plus linear_cross_entropy options."""

    name: str
    lead: tuple = (N,)
    bias: bool = False
    logit_std: float = 2.0
    ignore_frac: float = 0.0
    strided: bool = False
    options: dict = dataclasses.field(default_factory=dict)

    def inputs(self, device, dtype=torch.float32):
        inputs = random_inputs(
            self.lead,
            V,
            D,
            dtype=dtype,
            device=device,
            logit_std=self.logit_std,
            bias=self.bias,
            ignore_frac=self.ignore_frac,
            ignore_index=self.options.get("ignore_index", -100),
        )
        return strided_views(inputs) if self.strided else inputs


def strided_views(inputs):
    """Same values, non-contiguous layouts: e and targets stored [s, b] (as in Megatron) and seen
    as [b, s]; c rows padded (row stride D + 3); bias every other element of a buffer."""

    def transposed(x):
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    c = inputs["c"]
    padded = torch.cat([c, torch.zeros_like(c[:, :3])], dim=1)[:, : c.shape[1]]
    out = {"e": transposed(inputs["e"]), "c": padded, "targets": transposed(inputs["targets"]), "bias": None}
    if inputs["bias"] is not None:
        out["bias"] = torch.stack([inputs["bias"], torch.zeros_like(inputs["bias"])], dim=1)[:, 0]
    assert not any(x.is_contiguous() for x in out.values() if x is not None)
    return out


# Together these cover every option for each Triton impl; softcap cases scale the logits (std 20)
# so that tanh actually bends them.
TRITON_CASES = [
    Case("mean", options={"reduction": "mean"}),
    Case("bias-softcap-none", bias=True, logit_std=20.0, options={"softcap": 20.0, "reduction": "none"}),
    Case(
        "smoothing-zloss-ignored-sum",
        ignore_frac=0.3,
        options={"label_smoothing": 0.1, "z_loss": 1e-2, "reduction": "sum"},
    ),
    Case(
        "lse-3d-ignore-in-vocab",
        lead=(2, 19),
        ignore_frac=0.25,
        options={"ignore_index": 3, "z_loss": 1e-3, "reduction": "none", "return_lse": True},
    ),
    Case(
        "everything-3d",
        lead=(2, 19),
        bias=True,
        logit_std=20.0,
        ignore_frac=0.2,
        options={
            "ignore_index": -1,
            "softcap": 20.0,
            "label_smoothing": 0.1,
            "z_loss": 1e-3,
            "reduction": "mean",
            "return_lse": True,
        },
    ),
    Case("many-tokens", lead=(301,), ignore_frac=0.1, options={"z_loss": 1e-3, "reduction": "mean"}),
    Case(
        "strided-views",
        lead=(2, 19),
        bias=True,
        ignore_frac=0.2,
        strided=True,
        options={"label_smoothing": 0.1, "reduction": "none"},
    ),
    Case("all-ignored-sum", ignore_frac=1.0, options={"reduction": "sum", "return_lse": True}),
    Case("all-ignored-mean", ignore_frac=1.0, options={"reduction": "mean"}),
]
CASES = {case.name: case for case in TRITON_CASES}


def check_case(case: Case, impl: str, device, tol=None, uniform=False, **extra):
    inputs = case.inputs(device)
    options = dict(case.options, impl=impl, **extra)
    grad_loss, grad_lse = upstream(
        inputs["targets"], options.get("reduction", "mean"), options.get("return_lse"), uniform=uniform,
        ignore_index=options.get("ignore_index", -100),
    )
    return check_against_oracle(
        linear_cross_entropy,
        inputs,
        options,
        TIGHT if tol is None else tol,
        grad_loss=grad_loss,
        grad_lse=grad_lse,
        label=f"{impl}/{case.name}",
    )


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", TESTED_IMPLS)
def test_matches_oracle(impl, case, budget, device):
    if impl == "torch" and budget != "one-block":
        pytest.skip("the PyTorch path has no logits budget")
    check_case(case, impl, device, logits_budget=BUDGETS[budget])


@pytest.mark.parametrize("case", ["mean", "lse-3d-ignore-in-vocab", "strided-views"])
def test_triton_impls_agree(case, device):
    """Every Triton impl computes the same thing, bit for bit (plain calls: none learns from another)."""
    inputs = CASES[case].inputs(device)
    options = CASES[case].options
    grads = upstream(inputs["targets"], options.get("reduction", "mean"), options.get("return_lse"))
    outs = []
    for impl in IMPLS:
        if impl != "torch":
            outs.append(run(linear_cross_entropy, inputs, dict(options, impl=impl), *grads))
    for other in outs[1:]:
        for name, a, b in zip(outs[0]._fields, outs[0], other):
            assert (a is None and b is None) or torch.equal(a, b), f"{case}: Triton impls differ in {name}"


_TORCH_GRID = list(
    itertools.product(
        [False, True],  # bias
        [None, 20.0],  # softcap
        [0.0, 0.1],  # label_smoothing
        [0.0, 5e-3],  # z_loss
        [0.0, 0.3],  # fraction ignored
        [False, True],  # return_lse (with e shaped [2, 19, D])
        ["none", "sum", "mean"],
    )
)


@pytest.mark.parametrize(
    "bias, softcap, smoothing, z_loss, ignore_frac, return_lse, reduction",
    _TORCH_GRID,
    ids=lambda v: str(v),
)
def test_torch_impl_full_grid(bias, softcap, smoothing, z_loss, ignore_frac, return_lse, reduction):
    case = Case(
        "grid",
        lead=(2, 19) if return_lse else (N,),
        bias=bias,
        logit_std=20.0 if softcap else 2.0,
        ignore_frac=ignore_frac,
        options={
            "softcap": softcap,
            "label_smoothing": smoothing,
            "z_loss": z_loss,
            "reduction": reduction,
            "return_lse": return_lse,
        },
    )
    check_case(case, "torch", torch.device("cpu"))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_all_ignored(reduction, device):
    """Every token ignored: loss 0 (NaN for "mean", like F.cross_entropy), zero gradients."""
    inputs = Case("x", ignore_frac=1.0).inputs(device)
    out = run(linear_cross_entropy, inputs, {"reduction": reduction, "impl": "torch"})
    if reduction == "mean":
        assert torch.isnan(out.loss)
    else:
        assert not out.loss.any()
    for grad in (out.de, out.dc):
        assert not grad.any(), "gradients must be zero when every token is ignored"


@pytest.mark.parametrize("impl", ["torch", "cce"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_upstream_gradient_scales_grads(impl, reduction, device):
    inputs = Case("x", bias=True, ignore_frac=0.2).inputs(device)
    options = {"reduction": reduction, "impl": impl, "label_smoothing": 0.1}
    one = run(linear_cross_entropy, inputs, options)
    scale = torch.tensor(-3.25, device=device)
    scaled = run(linear_cross_entropy, inputs, options, grad_loss=scale)
    for name in ("de", "dc", "dbias"):
        err = rel_err(getattr(scaled, name), getattr(one, name).double() * -3.25)
        assert err <= 1e-6, f"{name}: upstream gradient -3.25 gives rel err {err:.2e}"


@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_exact_is_deterministic(budget, device):
    case = CASES["everything-3d"]
    inputs = case.inputs(device)
    options = dict(case.options, impl="exact", logits_budget=BUDGETS[budget])
    for kind in ("scalar", "lse"):
        grad_loss, grad_lse = upstream(inputs["targets"], options["reduction"], kind == "lse")
        first = run(linear_cross_entropy, inputs, options, grad_loss, grad_lse)
        second = run(linear_cross_entropy, inputs, options, grad_loss, grad_lse)
        for name, a, b in zip(first._fields, first, second):
            assert (a is None and b is None) or torch.equal(a, b), f"'exact' is not reproducible in {name}"


@pytest.mark.parametrize("impl", ["torch", "cce"])
def test_module_matches_function(impl, device):
    case = CASES["everything-3d"]
    inputs = case.inputs(device)
    options = dict(case.options, impl=impl)
    module = LinearCrossEntropy(**options)
    assert isinstance(module, torch.nn.Module)
    grad_loss, grad_lse = upstream(inputs["targets"], options["reduction"], True)
    from_module = run(
        lambda e, c, t, bias=None, **_: module(e, c, t, bias=bias), inputs, options, grad_loss, grad_lse
    )
    from_function = run(linear_cross_entropy, inputs, options, grad_loss, grad_lse)
    assert_errors_below(errors(from_module, from_function), 1e-6, f"{impl}: module vs function")


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("impl", TESTED_IMPLS)
def test_nan_in_e_propagates(impl, budget, device):
    """A NaN hidden state must give a NaN loss and NaN gradients, never be lost."""
    inputs = Case("x").inputs(device)
    inputs["e"][5, 7] = float("nan")
    options = {"impl": impl, "reduction": "none", "logits_budget": BUDGETS[budget]}
    out = run(linear_cross_entropy, inputs, options, torch.ones(N, device=device))
    assert torch.isnan(out.loss[5]), "NaN in e[5] did not reach loss[5]"
    others = torch.arange(N, device=device) != 5
    assert torch.isfinite(out.loss[others]).all(), "NaN in e[5] leaked into other tokens' losses"
    assert torch.isnan(out.de[5]).any(), "NaN in e[5] did not reach de[5]"
    assert torch.isfinite(out.de[others]).all(), "NaN in e[5] leaked into other rows of de"
    assert torch.isnan(out.dc).any(), "NaN in e[5] did not reach dc"


def test_oracle_agrees_with_plain_torch_in_fp64():
    """The two references are written independently; in float64 they must agree."""
    for case in TRITON_CASES:
        inputs = case.inputs("cpu", dtype=torch.float64)
        grad_loss, grad_lse = upstream(
            inputs["targets"], case.options["reduction"], case.options.get("return_lse")
        )
        ref = oracle(**inputs, grad_loss=grad_loss, grad_lse=grad_lse, **case.options)
        chunked = oracle(**inputs, grad_loss=grad_loss, grad_lse=grad_lse, chunk_size=5, **case.options)
        plain = plain_torch(**inputs, grad_loss=grad_loss, grad_lse=grad_lse, **case.options)
        assert_errors_below(errors(plain, ref), 1e-12, f"plain fp64 vs oracle, {case.name}")
        assert_errors_below(errors(chunked, ref), 1e-12, f"chunked vs dense oracle, {case.name}")


def test_cpu_without_interpreter_warns_and_uses_torch():
    """Without TRITON_INTERPRET, a Triton impl on CPU tensors warns and gives the "torch" result."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from cce_parallel import linear_cross_entropy
        torch.manual_seed(0)
        e, c = torch.randn(37, 48), torch.randn(517, 48)
        t = torch.randint(0, 517, (37,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = linear_cross_entropy(e, c, t, impl="cce")
        assert caught, "no warning"
        ref = linear_cross_entropy(e, c, t, impl="torch")
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0), (loss, ref)
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = child_pythonpath(root)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_low_precision_warns_and_uses_torch(dtype):
    """The Triton interpreter runs the kernels in fp32 only (bf16 gave a loss of 1e10 where 5.9 is
    right): low-precision CPU tensors warn and give the "torch" result, gradients included."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    torch.manual_seed(0)
    e = torch.randn(37, 48).to(dtype).requires_grad_()
    c = (torch.randn(517, 48) * 0.1).to(dtype).requires_grad_()
    t = torch.randint(0, 517, (37,))
    with pytest.warns(UserWarning, match="runs the kernels in float32 only"):
        loss = cce_parallel.linear_cross_entropy(e, c, t, impl="cce_kahan_full_c")
    grads = torch.autograd.grad(loss, (e, c))
    ref = cce_parallel.linear_cross_entropy(e, c, t, impl="torch")
    assert torch.equal(loss, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, (e, c))):
        assert got.dtype == dtype and torch.equal(got, want)


def test_public_api():
    assert set(cce_parallel.IMPLS) == {
        "cce",
        "cce_kahan",
        "cce_kahan_full_c",
        "cce_kahan_full_e",
        "exact",
        "torch",
    }


@pytest.mark.parametrize("top", [3.0e-9, 1.0 / 8192, 0.75, 1.0, 5.0e3])
def test_grad_scale_is_a_power_of_two_bringing_the_largest_coefficient_near_one(top):
    from cce_parallel.kernels import grad_scale

    a = torch.tensor([top / 3, -top, 0.0])
    b = torch.tensor([top / 2, 0.0, top / 7])
    scale = grad_scale(a, b).item()
    mantissa, _ = math.frexp(scale)
    assert mantissa == 0.5, f"scale {scale} is not a power of two"
    assert 1.0 <= top * scale < 2.0


@pytest.mark.parametrize("chunk_bytes", [6000, 40000])
def test_dense_forward_chunks_and_slices_match_oracle(chunk_bytes, device, monkeypatch):
    """The lean forward's fp32 logit chunks and their column slices (several partial splits per
    chunk, targets and label smoothing inside every slice) against the float64 oracle."""
    from cce_parallel.kernels import stats_slices
    from cce_parallel.kernels.config import INTERPRETER_CONFIG
    from cce_parallel.ops.common import logit_chunk

    monkeypatch.setenv("CCE_PARALLEL_KERNEL_CONFIG", f'{{"fwd_chunk_bytes": {chunk_bytes}, "fwd_programs": 64}}')
    case = CASES["everything-3d"]
    n = math.prod(case.inputs(device)["targets"].shape)
    vc = logit_chunk(n, V, chunk_bytes, 4, INTERPRETER_CONFIG.fwd_block_v)
    if chunk_bytes > 6000:
        assert stats_slices(n, vc, dataclasses.replace(INTERPRETER_CONFIG, fwd_programs=64), False) > 1
    check_case(case, "cce", device, logits_budget="lean")


@pytest.mark.parametrize(
    "chunk_bytes, min_cols, rows",
    [(1 << 20, 64, (38, 38)), (6000, 64, (19, 10)), (6000, 1 << 20, (2, 1))],
    ids=["one-token-block", "blocks", "smallest-blocks"],
)
def test_dense_token_blocks_match_oracle(chunk_bytes, min_cols, rows, device, monkeypatch):
    """The lean path with the tokens in one block, in several, and in blocks of one or two: the forward
    folds its partials as it goes, the backward sums dC over the blocks in fp32."""
    from cce_parallel.ops.common import dense_blocks

    fields = {"fwd_chunk_bytes": chunk_bytes, "bwd_workspace_bytes": chunk_bytes, "dense_min_cols": min_cols}
    fields.update(fwd_block_v=64, bwd_block_v=64)
    monkeypatch.setenv("CCE_PARALLEL_KERNEL_CONFIG", json.dumps(fields))
    case = CASES["everything-3d"]
    n = math.prod(case.inputs(device)["targets"].shape)
    assert n == 38
    fwd = dense_blocks(n, V, chunk_bytes, 4, 64, min_cols)
    bwd = dense_blocks(n, V, chunk_bytes, 4 + 4, 64, min_cols)
    assert (fwd[0], bwd[0]) == rows
    check_case(case, "cce_kahan_full_c", device, logits_budget="lean")
    check_case(CASES["strided-views"], "exact", device, logits_budget="lean")


def test_dense_blocks_keep_chunks_wide():
    """At the default budget, the chunk width stays at least dense_min_cols however many tokens there
    are (the token blocks shrink instead), within the budget, the blocks equal and covering all tokens."""
    from cce_parallel.kernels.config import KernelConfig
    from cce_parallel.ops.common import dense_blocks

    k = KernelConfig()
    for n in (1, 1000, 8192, 10000, 16384, 65536, 1 << 20):
        for bytes_per_logit, budget in ((4, k.fwd_chunk_bytes), (6, k.bwd_workspace_bytes)):
            rows, cols = dense_blocks(n, 256000, budget, bytes_per_logit, 128, k.dense_min_cols)
            assert cols >= k.dense_min_cols and cols % 128 == 0
            assert rows * cols * bytes_per_logit <= budget
            blocks = -(-n // rows)
            assert rows <= n and (blocks - 1) * rows < n <= blocks * rows
            if n * k.dense_min_cols * bytes_per_logit <= budget:
                assert rows == n
    assert dense_blocks(8192, 256000, 64 << 20, 6, 128, 1024) == (8192, 1280)  # as before blocks existed
