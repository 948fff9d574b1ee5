"""The one-pass path's decisions, against the float64 oracle (fp32, CPU under the interpreter).

The forward computes the gradients of grad_scale * per-token loss; the backward scales them when
the upstream gradient is one number over the kept tokens, scales dE per row and recomputes dC for
per-token weights, and recomputes everything for a gradient through lse. Each test checks both the
numbers and which way was taken.
"""

import math
import warnings

import pytest
import torch

from cce_parallel import linear_cross_entropy
from cce_parallel.ops import autograd
from tests.helpers import check_against_oracle, errors, random_inputs, run, upstream
from tests.oracle import oracle, rel_err

V, D, N = 517, 48, 37
TIGHT = {"loss": 1e-5, "lse": 1e-5, "de": 5e-5, "dc": 5e-5, "dbias": 5e-5}
IMPL = "cce_kahan_full_c"


@pytest.fixture
def lean_calls(monkeypatch):
    """Records the calls of the lean backward (the recompute) and whether each wanted dE."""
    calls = []
    real = autograd.lean_backward

    def spy(*args, need_de=True, **kwargs):
        calls.append(need_de)
        return real(*args, need_de=need_de, **kwargs)

    monkeypatch.setattr(autograd, "lean_backward", spy)
    return calls


def inputs(device, **kw):
    kw.setdefault("ignore_frac", 0.2)
    return random_inputs((N,), V, D, device=device, bias=True, **kw)


@pytest.mark.parametrize("budget", ["auto", 3 * 4 * V])
def test_uniform_upstream_over_kept_tokens_only_scales(budget, device, lean_calls):
    """Megatron's loss_mask / count with the mask folded into ignore_index: no recompute, no warning."""
    x = inputs(device)
    options = {"impl": IMPL, "reduction": "none", "logits_budget": budget, "label_smoothing": 0.1}
    grad_loss, _ = upstream(x["targets"], "none", False, uniform=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_against_oracle(linear_cross_entropy, x, options, TIGHT, grad_loss=grad_loss, label="uniform")
    assert lean_calls == []


def test_per_token_weights_scale_de_and_recompute_dc(device, lean_calls):
    x = inputs(device)
    options = {"impl": IMPL, "reduction": "none", "z_loss": 1e-3}
    grad_loss, _ = upstream(x["targets"], "none", False)
    with pytest.warns(UserWarning, match="not one number"):
        check_against_oracle(linear_cross_entropy, x, options, TIGHT, grad_loss=grad_loss, label="weights")
    assert lean_calls == [False], "dC and dbias are recomputed once, dE is not"
    # The next per-token call takes the lean path from the start (its backward computes dE too).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_against_oracle(linear_cross_entropy, x, options, TIGHT, grad_loss=grad_loss, label="weights, later")
    assert lean_calls == [False, True]
    # reduction "mean" keeps the one-pass path.
    run(linear_cross_entropy, x, dict(options, reduction="mean"))
    assert lean_calls == [False, True]


def test_gradient_through_lse_recomputes_everything(device, lean_calls):
    x = inputs(device)
    options = {"impl": IMPL, "reduction": "mean", "return_lse": True}
    grad_loss, grad_lse = upstream(x["targets"], "mean", True)
    check_against_oracle(
        linear_cross_entropy, x, options, TIGHT, grad_loss=grad_loss, grad_lse=grad_lse, label="lse"
    )
    assert lean_calls == [True]


def test_unused_lse_does_not_recompute(device, lean_calls):
    x = inputs(device)
    out = run(linear_cross_entropy, x, {"impl": IMPL, "reduction": "sum", "return_lse": True})
    ref = oracle(**x, reduction="sum")
    assert errors(out, ref)["dc"] < 5e-5
    assert lean_calls == []


@pytest.mark.parametrize("budget", ["auto", 3 * 4 * V])
@pytest.mark.parametrize("case", ["wide", "rising"])
def test_large_logit_gaps_stay_exact(case, budget, device):
    """Logits whose exp overflows fp32 from any fixed reference. "wide": targets trail their row's top
    logit by more than 100. "rising": a bias that grows by 5 per vocabulary row, so every tile of the
    one-pass kernel tops the last by more than its lift (20): the row's reference rises tile by tile
    and the W already written is rescaled each time."""
    if case == "wide":
        x = inputs(device, logit_std=400.0)
    else:
        x = inputs(device)
        x["bias"] = (5.0 * torch.arange(V, device=device, dtype=torch.float32)).requires_grad_()
    probe = x["e"].double() @ x["c"].double().t() + x["bias"].double()
    gap = probe.max(dim=1).values - probe.gather(1, x["targets"].clamp(min=0)[:, None]).squeeze(1)
    assert gap.max() > 100, "the case must overflow exp(z - target logit)"
    tol = dict(TIGHT, de=2e-4, dc=2e-4, dbias=2e-4)  # logits of 1e3: fp32 sums of them lose ~1e-4
    check_against_oracle(
        linear_cross_entropy, x, {"impl": IMPL, "reduction": "mean", "logits_budget": budget}, tol, label=case
    )


@pytest.mark.parametrize("budget", ["auto", "lean"])
def test_minus_inf_bias_masks_rows_of_the_vocabulary(budget, device):
    """A bias of -inf removes vocabulary rows (here the first 150, several kernel tiles, so that a
    row's first tiles hold no finite logit at all): the loss and gradients equal the call on the
    remaining rows, and those rows get zero gradients."""
    x = inputs(device)
    cut = 150
    x["targets"] = torch.where(x["targets"] >= 0, x["targets"] % (V - cut) + cut, x["targets"])
    bias = x["bias"].detach().clone()
    bias[:cut] = float("-inf")
    options = {"impl": IMPL, "reduction": "mean", "logits_budget": budget}
    e, c = x["e"].detach().clone().requires_grad_(), x["c"].detach().clone().requires_grad_()
    loss = linear_cross_entropy(e, c, x["targets"], bias=bias, **options)
    loss.backward()
    e2, c2 = x["e"].detach().clone().requires_grad_(), x["c"][cut:].detach().clone().requires_grad_()
    want = linear_cross_entropy(e2, c2, x["targets"] - cut * (x["targets"] >= 0), bias=bias[cut:], **options)
    want.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert rel_err(e.grad, e2.grad) < 1e-6
    assert rel_err(c.grad[cut:], c2.grad) < 1e-6
    assert not c.grad[:cut].any()


def test_probs_rows_reference_follows_the_row_maximum(device):
    """The in-place pass: W = exp(z - ref) for every column, ref within the lift below the row's
    largest z, including rows whose maximum arrives only in a late tile."""
    from cce_parallel import kernels

    cfg = kernels.default_config(torch.device(device))
    g = torch.Generator(device).manual_seed(3)
    z = torch.randn(5, 300, device=device, generator=g, dtype=torch.float64) * 3
    z[1] += torch.linspace(0, 400, 300, device=device, dtype=torch.float64)  # rising: lifts in every tile
    z[2, -1] = 300.0  # one late outlier
    z[3, 0] = 300.0  # the first tile holds the maximum
    targets = torch.tensor([0, 299, 5, 7, 400], device=device)  # 400: held by another rank
    x = z.float().clone()
    w, ref, s, zt, _ = kernels.probs_rows_in_place(x, None, targets, torch.float32, softcap=None,
                                                   need_zsum=False, config=cfg)
    top = z.float().double().max(dim=1).values  # the kernel's z: fp32
    assert bool(((top - ref.double()) >= 0).all()) and bool(((top - ref.double()) <= 20).all())
    expect = torch.exp(z.float().double() - ref.double()[:, None])
    assert rel_err(w.double(), expect) < 1e-6
    assert rel_err(s.double(), expect.sum(dim=1)) < 1e-6
    zf = z.float()
    assert zt.tolist()[:4] == [zf[0, 0].item(), zf[1, 299].item(), zf[2, 5].item(), zf[3, 7].item()]
    assert zt[4].item() == 0.0


@pytest.mark.parametrize("impl", ["cce", "cce_kahan_full_c", "torch"])
@pytest.mark.parametrize("budget", ["auto", "lean"])
@pytest.mark.parametrize("softcap", [1e5, 1e8, 1e30])
def test_huge_softcap_is_no_softcap(softcap, budget, impl, device):
    """softcap * tanh(x / softcap) = x to fp32 precision once softcap >> |x|: tanh of small arguments
    must not cancel (it did: losses off by 0.3 at 1e5 and 4.4 at 1e30)."""
    x = inputs(device, logit_std=20.0)
    options = {"impl": impl, "reduction": "none", "logits_budget": budget}
    capped = run(linear_cross_entropy, x, dict(options, softcap=softcap))
    plain = oracle(**x, reduction="none")
    errs = errors(capped, plain)
    assert errs["loss"] < 1e-5 and errs["de"] < 5e-5 and errs["dc"] < 5e-5, errs


def test_double_backward_is_a_clear_error(device):
    x = inputs(device)
    e = x["e"].detach().requires_grad_()
    loss = linear_cross_entropy(e, x["c"], x["targets"], impl=IMPL)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(loss, e, create_graph=True)


def test_no_grad_computes_only_the_loss(device, monkeypatch):
    x = inputs(device)

    def fail(*args, **kwargs):
        raise AssertionError("the one-pass path ran without a gradient to compute")

    monkeypatch.setattr(autograd, "one_pass", fail)
    with torch.no_grad():
        loss = linear_cross_entropy(x["e"], x["c"], x["targets"], bias=x["bias"], impl=IMPL)
    with torch.inference_mode():
        again = linear_cross_entropy(x["e"], x["c"], x["targets"], bias=x["bias"], impl=IMPL)
    ref = oracle(**x, reduction="mean").loss
    assert rel_err(loss, ref) < 1e-5 and torch.equal(loss, again)


@pytest.mark.parametrize("which", ["e", "c", "bias"])
def test_only_one_input_needs_a_gradient(which, device):
    x = inputs(device)
    leaves = {k: x[k].detach().requires_grad_(k == which) for k in ("e", "c", "bias")}
    loss = linear_cross_entropy(leaves["e"], leaves["c"], x["targets"], bias=leaves["bias"], impl=IMPL)
    loss.backward()
    ref = oracle(**x, reduction="mean")
    got = leaves[which].grad
    want = {"e": ref.de, "c": ref.dc, "bias": ref.dbias}[which]
    assert rel_err(got, want) < 5e-5
    for other in {"e", "c", "bias"} - {which}:
        assert leaves[other].grad is None


@pytest.mark.parametrize("kind", ["scalar", "weights", "lean"])
def test_main_grad_receives_dc(kind, device):
    """With main_grad, dC is added into that buffer (which already holds a gradient), and c.grad is
    left alone."""
    x = inputs(device)
    e = x["e"].detach().requires_grad_()
    c = x["c"].detach().requires_grad_()
    before = torch.randn(V, D, device=device)
    buffer = before.clone()
    options = {"impl": IMPL, "reduction": "none", "logits_budget": "lean" if kind == "lean" else "auto"}
    grad_loss, _ = upstream(x["targets"], "none", False, uniform=kind != "weights")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = linear_cross_entropy(e, c, x["targets"], main_grad=lambda: buffer, **options)
        loss.backward(grad_loss)
    ref = oracle(e=x["e"], c=x["c"], targets=x["targets"], reduction="none", grad_loss=grad_loss)
    assert rel_err(buffer - before, ref.dc) < 5e-5
    assert rel_err(e.grad, ref.de) < 5e-5
    assert c.grad is None


def test_main_grad_must_match_c(device):
    x = inputs(device)
    c = x["c"].detach().requires_grad_()
    with pytest.raises(ValueError, match="main_grad must be a floating-point tensor shaped like c"):
        linear_cross_entropy(x["e"], c, x["targets"], main_grad=torch.zeros(V + 1, D, device=device))
    with pytest.raises(TypeError, match="main_grad must be a tensor"):
        linear_cross_entropy(x["e"], c, x["targets"], main_grad="buffer")


def test_token_blocks_are_equal_and_fit_the_budget():
    for n in (1, 37, 1000, 8192, 65536):
        for v, budget in ((517, 6000), (256000, 2 << 30), (32064, 1 << 20), (128256, 1)):
            rows = autograd.token_block(n, v, budget)
            blocks = math.ceil(n / rows)
            assert rows >= 1 and (blocks - 1) * rows < n <= blocks * rows
            assert rows == 1 or rows * v * 4 <= budget
