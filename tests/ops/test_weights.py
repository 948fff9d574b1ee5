"""Per-token weights known in the forward (`weights=`), and a call's path decided by its own
arguments and the state it is given (ops/upstream.py), never by other calls in the process.

fp32 against the float64 oracle (CPU under the interpreter, or CUDA with CCE_TEST_GPU=1).
"""

import functools
import warnings

import pytest
import torch

from cce_parallel import LinearCrossEntropy, UpstreamState, linear_cross_entropy
from cce_parallel.ops import autograd
from tests.helpers import check_against_oracle, random_inputs, run, upstream
from tests.oracle import oracle, rel_err

V, D, N = 517, 48, 37
TIGHT = {"loss": 1e-5, "lse": 1e-5, "de": 5e-5, "dc": 5e-5, "dbias": 5e-5}
IMPL = "cce_kahan_full_c"


@pytest.fixture
def recomputes(monkeypatch):
    """Counts the backward's recomputes: the lean backward and kernels.weighted_grads' flag."""
    from cce_parallel import kernels

    calls = {"lean": 0, "flagged": 0}
    lean, weighted = autograd.lean_backward, kernels.weighted_grads

    def spy_lean(*args, **kwargs):
        calls["lean"] += 1
        return lean(*args, **kwargs)

    def spy_weighted(flag, *args, **kwargs):
        calls["flagged"] += int(flag.item())
        return weighted(flag, *args, **kwargs)

    monkeypatch.setattr(autograd, "lean_backward", spy_lean)
    monkeypatch.setattr(kernels, "weighted_grads", spy_weighted)
    return calls


def _weights(targets, kind, seed=5):
    g = torch.Generator().manual_seed(seed)
    if kind == "mask":
        return (torch.rand(targets.shape, generator=g) >= 0.1).float().to(targets.device)
    return torch.randn(targets.shape, generator=g).to(targets.device)  # signed, as RL advantages


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", ["signed", "mask"])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0, "z_loss": 1e-3}, {"label_smoothing": 0.1},
                                     {"logits_budget": 3 * 4 * V}, {"logits_budget": "lean", "return_lse": True}])
def test_weights_match_the_oracle_in_one_pass(options, kind, reduction, device, recomputes):
    """Every kept token's loss times its weight; "mean" over the weights' sum. The one-pass
    gradients are made for the weights in the forward, so an upstream gradient that is one number
    moves nothing in the backward: no recompute (the lean path recomputes by design)."""
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2)
    w = _weights(x["targets"], kind)
    options = dict(options, impl=IMPL, reduction=reduction, weights=w)
    grad_loss, grad_lse = upstream(x["targets"], reduction, options.get("return_lse"), uniform=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_against_oracle(linear_cross_entropy, x, options, TIGHT, grad_loss=grad_loss, grad_lse=grad_lse,
                             label=f"weights {kind} {reduction}")
    lean = options.get("logits_budget") == "lean"
    assert recomputes == {"lean": int(lean), "flagged": 0}


def test_weights_and_an_upstream_per_token_are_both_applied(device, recomputes):
    """reduction="none" with weights, then another per-token factor in the backward: exact (its
    dC recomputed for the product, as for any weights that come only in the backward)."""
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2)
    w = _weights(x["targets"], "signed")
    grad_loss, _ = upstream(x["targets"], "none", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_against_oracle(linear_cross_entropy, x, {"impl": IMPL, "reduction": "none", "weights": w}, TIGHT,
                             grad_loss=grad_loss, label="weights x upstream")
    assert recomputes["flagged"] == 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_weights_that_require_grad_get_the_per_token_loss(reduction, device):
    x = random_inputs((N,), V, D, device=device, ignore_frac=0.2)
    w = _weights(x["targets"], "signed").requires_grad_()
    loss = linear_cross_entropy(x["e"], x["c"], x["targets"], weights=w, reduction=reduction, impl=IMPL)
    g = torch.randn(loss.shape, device=device)
    (loss * g).sum().backward()
    w64 = w.detach().double().requires_grad_()
    ce = oracle(x["e"], x["c"], x["targets"], reduction="none").loss  # 0 at ignored tokens
    keep = (x["targets"] != -100).double()
    ref = ce * w64 if reduction == "none" else (ce * w64).sum() / (w64 * keep).sum()
    (ref * g.double()).sum().backward()
    assert rel_err(w.grad, w64.grad) < 1e-5


def test_weights_summing_to_zero_give_zero_gradients_and_nan_mean(device):
    """Nothing kept (or weights whose sum is 0): the mean is 0 / 0, NaN as in PyTorch, and the
    gradients are 0, not NaN."""
    x = random_inputs((N,), V, D, device=device, ignore_frac=1.0)
    out = run(linear_cross_entropy, x, {"impl": IMPL, "weights": torch.ones(N, device=device)})
    assert out.loss.isnan() and not out.de.any() and not out.dc.any()


@pytest.mark.parametrize("bad, match", [
    (lambda t: torch.ones(t.shape[0] + 1), r"weights \(38,\) must equal targets' shape \(37,\)"),
    (lambda t: torch.ones(t.shape, dtype=torch.int64), "weights must be a floating-point tensor"),
    (lambda t: [1.0] * t.shape[0], "weights must be a torch.Tensor or None"),
])
def test_bad_weights_are_named(bad, match, device):
    x = random_inputs((N,), V, D, device=device)
    w = bad(x["targets"])
    if isinstance(w, torch.Tensor):
        w = w.to(device)
    with pytest.raises((ValueError, TypeError), match=match):
        linear_cross_entropy(x["e"], x["c"], x["targets"], weights=w)


def test_each_call_takes_the_path_its_own_arguments_choose(device, recomputes):
    """In one process: a per-token loss weighted only in the backward (a recompute, and its module
    learns to go lean), then the masked loss (weights=) and the plain mean, through plain calls and
    through fresh modules. None of them is slowed by the first: each runs one pass, without a
    recompute. What ran is read from each module's state (paths), the one-pass calls and the
    recompute counters."""
    x = random_inputs((N,), V, D, device=device, ignore_frac=0.1)
    e, c, t = (x[k] for k in ("e", "c", "targets"))
    mask = _weights(t, "mask")
    weights = torch.rand(t.shape, generator=torch.Generator().manual_seed(2)).to(device)
    one_pass = []
    real = autograd.one_pass
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autograd, "one_pass", lambda *a, **k: one_pass.append(1) or real(*a, **k))

        def step(loss_fn, after=None, **kw):
            e1, c1 = e.detach().requires_grad_(), c.detach().requires_grad_()
            loss = loss_fn(e1, c1, t, **kw)
            (loss if after is None else after(loss)).backward()
            return e1.grad, c1.grad

        weighted = LinearCrossEntropy(impl=IMPL, reduction="none")
        with pytest.warns(UserWarning, match="neither one number"):
            step(weighted, after=lambda loss: (loss * weights).sum())
            weighted.state.read_reports()  # now, not after the next forward (a GPU host would learn then)
        assert weighted.state.paths == {"one_pass": 1, "checked": 1, "recomputed": 1}
        assert weighted.state.per_token_weights_seen and recomputes == {"lean": 0, "flagged": 1}
        # The same module learned to leave dC to the backward in its next weighted call ...
        step(weighted, after=lambda loss: (loss * weights).sum())
        assert weighted.state.paths["deferred"] == 1 and len(one_pass) == 3
        # ... but nothing else did: plain calls and other modules take one pass, no recompute.
        masked = LinearCrossEntropy(impl=IMPL)
        mean = LinearCrossEntropy(impl=IMPL)
        folded_mean = lambda loss: loss.sum() / (t != -100).sum()  # noqa: E731 (Megatron's, mask folded)
        calls = [(masked, {"weights": mask}, None), (mean, {}, None),
                 (functools.partial(linear_cross_entropy, impl=IMPL, reduction="none"), {}, folded_mean),
                 (functools.partial(linear_cross_entropy, impl=IMPL), {"weights": mask}, None)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for loss_fn, kw, after in calls:
                de, dc = step(loss_fn, after=after, **kw)
                ref = oracle(e, c, t, reduction="mean", weights=kw.get("weights"))
                assert rel_err(de, ref.de) < 5e-5 and rel_err(dc, ref.dc) < 5e-5
        assert len(one_pass) == 3 + len(calls) and recomputes == {"lean": 0, "flagged": 1}
        for module in (masked, mean):
            assert module.state.paths == {"one_pass": 1, "scaled": 1}
            assert not module.state.per_token_weights_seen and not module.state.masked_weights_seen
        # Forgetting what it learned puts the weighted module back on the one-pass path.
        weighted.reset_state()
        assert weighted.state.paths == {} and not weighted.state.per_token_weights_seen
        step(weighted, after=lambda loss: loss.sum())
        assert weighted.state.paths == {"one_pass": 1, "scaled": 1}


def test_module_shows_its_state(device):
    loss_fn = LinearCrossEntropy(impl=IMPL)
    assert "state=UpstreamState(loss_scale=1, paths={})" in repr(loss_fn)
    state = UpstreamState()
    state.per_token_weights_seen = True
    assert "per_token_weights_seen=True" in repr(state)
