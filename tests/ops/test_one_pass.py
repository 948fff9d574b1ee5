"""The one-pass path's decisions, against the float64 oracle (fp32, CPU under the interpreter).

The forward computes the gradients of grad_scale * per-token loss; the backward scales them when
the upstream gradient is one number over the kept tokens, subtracts the masked rows' part where it
is one number and 0 (a loss mask not folded into ignore_index), scales dE per row and recomputes
dC for other per-token weights, and recomputes everything for a gradient through lse. Each test checks both the
numbers and which way was taken.
"""

import functools
import math
import warnings

import pytest
import torch

from cce_parallel import LinearCrossEntropy, linear_cross_entropy
from cce_parallel.ops import autograd, common
from cce_parallel.ops import one_pass as one_pass_module
from cce_parallel.ops.upstream import UpstreamState
from tests.helpers import check_against_oracle, errors, random_inputs, run, upstream
from tests.oracle import oracle, rel_err

V, D, N = 517, 48, 37
TIGHT = {"loss": 1e-5, "lse": 1e-5, "de": 5e-5, "dc": 5e-5, "dbias": 5e-5}
IMPL = "cce_kahan_full_c"


@pytest.fixture
def lean_calls(monkeypatch):
    """Records the calls of the lean backward (the recompute) and whether each wanted dE; the
    number of tokens each got goes into lean_calls.rows."""
    calls = _Calls()
    real = autograd.lean_backward

    def spy(*args, need_de=True, **kwargs):
        calls.append(need_de)
        calls.rows.append(args[0].shape[0])
        return real(*args, need_de=need_de, **kwargs)

    monkeypatch.setattr(autograd, "lean_backward", spy)
    return calls


@pytest.fixture
def state():
    """The UpstreamState a loss module would own: what its backwards teach it (ops/upstream.py)."""
    return UpstreamState()


@pytest.fixture
def pass_rows(monkeypatch):
    """The number of tokens of each one-pass call (the forward's, and a mask's correction in the
    backward, which takes the masked rows alone)."""
    rows = []
    real = autograd.one_pass
    monkeypatch.setattr(autograd, "one_pass", lambda e, *a, **k: rows.append(e.shape[0]) or real(e, *a, **k))
    return rows


def _then_flags(call, state):
    """call(), then read the backward's report as the next call would: on a GPU the host learns of
    per-token weights after the next call's forward (UpstreamState.read_reports), on a CPU at once."""
    call()
    state.read_reports()


class _Calls(list):
    def __init__(self):
        super().__init__()
        self.rows = []


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


@pytest.mark.parametrize("budget", ["auto", 3 * 4 * V])
def test_ignore_index_may_be_a_token_of_the_vocabulary(budget, device):
    """ignore_index may be a real token id (a pad token). The fused GEMM takes the caller's targets
    before the targets' pass and so picks that token's logit in ignored rows too; it must reach
    neither the loss nor the gradients. int32 targets, as a data loader may hand them over."""
    x = inputs(device, ignore_index=3)
    x["targets"][::4] = 3
    x["targets"] = x["targets"].int()
    options = {"impl": IMPL, "reduction": "mean", "logits_budget": budget, "ignore_index": 3}
    check_against_oracle(linear_cross_entropy, x, options, TIGHT, label="ignore_index=3")


def test_megatron_mask_over_count_hands_out_dc_unscaled(device, lean_calls, monkeypatch, state):
    """(loss * mask).sum() / mask.sum() with the mask folded into ignore_index: the upstream gradient
    is exactly the forward's 1 / kept, so the device finds ratio 1 (dC and dbias scale by it, which
    moves nothing) and no per-token weights (the recompute's programs return at once), with no host
    sync; dE scales per row."""
    from cce_parallel import kernels

    x = inputs(device)
    ratios, flags = [], []
    real_scale, real_weighted = kernels.scale_, kernels.weighted_grads
    monkeypatch.setattr(kernels, "scale_", lambda t, s: ratios.append(s.item()) or real_scale(t, s))
    monkeypatch.setattr(kernels, "weighted_grads",
                        lambda flag, *a, **k: flags.append(flag.item()) or real_weighted(flag, *a, **k))
    e, c = x["e"].detach().requires_grad_(), x["c"].detach().requires_grad_()
    mask = (x["targets"] != -100).float()
    loss = (linear_cross_entropy(e, c, x["targets"], impl=IMPL, reduction="none", state=state) * mask).sum()
    loss = loss / mask.sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss.backward()
    ref = oracle(e.detach(), c.detach(), x["targets"], reduction="mean")
    assert rel_err(e.grad, ref.de) < 5e-5 and rel_err(c.grad, ref.dc) < 5e-5
    assert ratios == [1.0] and flags == [0] and lean_calls == []
    assert not state.per_token_weights_seen and not state.masked_weights_seen
    assert state.paths == {"one_pass": 1, "checked": 1}


@pytest.mark.parametrize("options", [{"z_loss": 1e-3}, {"label_smoothing": 0.1, "softcap": 3.0}])
def test_per_token_weights_scale_de_and_recompute_dc(options, device, lean_calls, state):
    """Per-token weights only in the backward: dE scales per row, kernels.weighted_grads recomputes
    dC and dbias (the lean backward does not run), and the state learns of them: the next per-token
    call that passes it makes dE alone in its forward and dC in its backward (deferred); a call
    without it makes all of them in the forward again."""
    x = inputs(device)
    options = dict(options, impl=IMPL, reduction="none")
    loss_fn = functools.partial(linear_cross_entropy, state=state)
    grad_loss, _ = upstream(x["targets"], "none", False)
    with pytest.warns(UserWarning, match="neither one number"):
        _then_flags(lambda: check_against_oracle(loss_fn, x, options, TIGHT, grad_loss=grad_loss,
                                                 label="weights"), state)
    assert state.per_token_weights_seen and lean_calls == []
    assert state.paths == {"one_pass": 1, "checked": 1, "recomputed": 1}
    # The next per-token call defers dC to its backward, which recomputes nothing else.
    made = []
    real = autograd.one_pass
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autograd, "one_pass", lambda *a, **k: made.append((a[8].need_de, a[8].need_dc)) or real(*a, **k))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_against_oracle(loss_fn, x, options, TIGHT, grad_loss=grad_loss, label="weights, later")
        assert made == [(True, False), (False, True)] and lean_calls == [] and state.paths["deferred"] == 1
        # reduction "mean" makes them all in the forward, and so does a call that passes no state.
        run(loss_fn, x, dict(options, reduction="mean"))
        run(linear_cross_entropy, x, options, grad_loss)
    assert made[2:] == [(True, True), (True, True)] and lean_calls == [] and state.paths["one_pass"] == 3


def test_nan_weight_reaches_the_gradients(device, lean_calls, state):
    """A NaN upstream gradient on one kept token (the others one number and 0) is "many" weights:
    kernels.weighted_grads recomputes, and the NaN reaches dC as it would in plain PyTorch."""
    x = inputs(device)
    grad_loss, _ = upstream(x["targets"], "none", False, uniform=True, masked=0.2)
    kept = (x["targets"] != -100).nonzero().squeeze(1)
    grad_loss[kept[0]] = float("nan")
    outs = []
    with pytest.warns(UserWarning, match="neither one number"):
        _then_flags(lambda: outs.append(run(linear_cross_entropy, x, {"impl": IMPL, "reduction": "none",
                                                                      "state": state}, grad_loss)), state)
    out = outs[0]
    assert out.dc.isnan().any() and out.de[kept[0]].isnan().all() and lean_calls == []
    assert state.per_token_weights_seen


def _masked_case(device, masked, scale=3.0, **kw):
    """Inputs and Megatron's (loss * loss_mask).sum() / loss_mask.sum() * scale as the upstream
    gradient of a per-token loss, the mask not folded into ignore_index: scale / count on the
    kept unmasked tokens, 0 on the masked ones (some of them ignored too)."""
    x = inputs(device, **kw)
    g = torch.Generator().manual_seed(11)
    mask = (torch.rand(x["targets"].shape, generator=g) >= masked).float().to(device)
    grad_loss = mask * (scale / mask.sum())
    masked_kept = int(((mask == 0) & (x["targets"] != -100)).sum())
    assert masked_kept > 0
    return x, grad_loss, masked_kept


@pytest.mark.parametrize("masked", [0.1, 0.3])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0}, {"label_smoothing": 0.1}, {"z_loss": 1e-3},
                                     {"label_smoothing": 0.1, "softcap": 3.0, "logits_budget": 3 * 4 * V}])
def test_masked_upstream_subtracts_the_masked_rows(options, masked, device, lean_calls, pass_rows, state):
    """Megatron's loss_mask / count with the mask not folded (one number on the kept tokens, 0 on
    the masked ones): the first call's weights are sorted on the device (kernels.weighted_grads
    recomputes dC and dbias; the host learns of the mask: masked_weights_seen, no warning); later
    calls sort them on the host, and dC and dbias are that number times (the forward's, minus the
    masked rows' part), the part made by one more pass on the masked kept rows alone; dE scales
    per row."""
    x, grad_loss, masked_kept = _masked_case(device, masked)
    options = dict(options, impl=IMPL, reduction="none")
    loss_fn = functools.partial(linear_cross_entropy, state=state)
    for call in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_against_oracle(loss_fn, x, options, TIGHT, grad_loss=grad_loss, label=f"masked {call}")
            state.read_reports()
        assert lean_calls == [] and pass_rows == [N] + [masked_kept] * (call > 0)
        pass_rows.clear()
        assert state.masked_weights_seen and not state.per_token_weights_seen
    assert state.paths == {"one_pass": 3, "checked": 1, "recomputed": 1, "mask_corrected": 2}


def test_masked_rows_taken_out_before_the_sync_follow_the_last_mask(device, lean_calls, pass_rows, state):
    """The correction of as many masked rows as the last mask had is queued before the host learns
    this one's count (UpstreamState.masked_rows): a mask with more masked rows takes the rest in a
    second sweep, one with fewer leaves the surplus rows without weight, and weights that turn out
    to be one number take nothing out. Each call's gradients match the oracle."""
    x = inputs(device)
    kept = x["targets"] != -100
    draws = torch.rand(x["targets"].shape, generator=torch.Generator().manual_seed(5)).to(device)
    options = {"impl": IMPL, "reduction": "none", "state": state}
    # (fraction masked, one-pass rows the call makes: its forward and its corrections in order)
    plan = [(0.1, None), (0.1, None), (0.3, "more"), (0.15, "fewer"), (0.0, "none")]
    learned = []
    for call, (masked, case) in enumerate(plan):
        mask = (draws >= masked).float()
        count = int(((mask == 0) & kept).sum())
        grad_loss = mask * (3.0 / mask.sum())
        check_against_oracle(linear_cross_entropy, x, options, TIGHT, grad_loss=grad_loss, label=f"call {call}")
        state.read_reports()  # now, not after the next forward (a GPU host would learn then)
        if case == "more":
            assert pass_rows == [N, learned[-1], count - learned[-1]] and count > learned[-1]
        elif case == "fewer":
            assert pass_rows == [N, learned[-1]] and count < learned[-1]
        elif case == "none":
            assert pass_rows == [N, learned[-1]] and count == 0
        pass_rows.clear()
        learned.append(state.masked_rows)
    assert learned[1:4] == [int(((draws < f) & kept).sum()) for f in (0.1, 0.3, 0.15)]
    assert learned[4] == learned[3]  # one number teaches no mask
    assert lean_calls == [] and state.paths["mask_corrected"] == 3 and state.paths["scaled"] == 1
    assert f"masked_rows={learned[4]}" in repr(state)
    state.reset()
    assert state.masked_rows == 0


def test_masked_upstream_into_main_grad(device, lean_calls, pass_rows, state):
    """With Megatron's main_grad (gradient-accumulation fusion) dC goes into it: recomputed by the
    device at the first call, corrected on the masked rows (fp32, unrounded) at the second; c gets
    no gradient."""
    from cce_parallel.ops import functional

    x, grad_loss, masked_kept = _masked_case(device, 0.2)
    ref = oracle(x["e"], x["c"], x["targets"], bias=x["bias"], reduction="none", grad_loss=grad_loss)
    for call in range(2):
        e, c, bias = (x[k].detach().requires_grad_() for k in ("e", "c", "bias"))
        buffer = torch.full(c.shape, 0.5, device=device)
        loss = functional.sharded_linear_cross_entropy(e, c, x["targets"], bias=bias, impl=IMPL, reduction="none",
                                                       c_main_grad=lambda buffer=buffer: buffer, state=state)
        loss.backward(grad_loss)
        state.read_reports()
        assert c.grad is None and lean_calls == [] and pass_rows == [N] + [masked_kept] * (call > 0)
        pass_rows.clear()
        assert rel_err(buffer - 0.5, ref.dc) < 5e-5 and rel_err(e.grad, ref.de) < 5e-5
        assert rel_err(bias.grad, ref.dbias) < 5e-5


def test_all_kept_masked_and_nothing_kept_give_zeros(device, lean_calls):
    """Weights 0 on every kept token are one number (0): zeros, no recompute."""
    x = inputs(device)
    out = run(linear_cross_entropy, x, {"impl": IMPL, "reduction": "none"}, torch.zeros(N, device=device))
    assert not out.de.any() and not out.dc.any() and not out.dbias.any() and lean_calls == []


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
    logit by more than 100. "rising": a bias that grows by 5 per vocabulary row, so the fused GEMM's
    tiles of one row get different references, and the row's W are brought to the largest by
    powers of two."""
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


def test_fused_gemm_references_are_exact_powers_of_two(device):
    """The fused logits GEMM: W = exp(z - ref) for every column, ref a multiple of 128 log2 units
    within 44.4 nats of the row's largest z, including rows whose tiles start with different
    references (rising logits, a late outlier, all logits far below 0) that must be rescaled."""
    from cce_parallel import kernels

    cfg = kernels.default_config(torch.device(device))
    g = torch.Generator(device).manual_seed(3)
    z = torch.randn(7, 300, device=device, generator=g, dtype=torch.float64) * 3
    z[1] += torch.linspace(0, 400, 300, device=device, dtype=torch.float64)  # a new reference every few tiles
    z[2, -1] = 300.0  # one late outlier
    z[3, 0] = 300.0  # the first tile holds the maximum
    z[4] -= 500.0  # every logit far below 0
    z[5, 40:] -= 100.0  # tiles on both sides of a reference boundary
    # Two tiles one reference apart whose sums both count: rescaling the lower one by 2^-128 in one
    # factor flushed it to 0 on a GPU (the interpreter keeps subnormals).
    z[6, 0], z[6, 299] = 45.0, 43.0
    targets = torch.tensor([0, 299, 5, 7, 310, 41, 299], device=device)  # 310: past V, in its last tile
    # e = z and c = the identity: the GEMM reproduces z exactly.
    e = z.float().contiguous()
    c = torch.eye(300, device=device, dtype=torch.float32)
    w = torch.empty(7, 300, device=device, dtype=torch.float32)
    zt = torch.zeros(7, device=device)
    ref, s, _, _ = kernels.logits_probs(e, c, None, targets, 0, w, zt, softcap=None, need_zsum=False, config=cfg)
    zf = e.double()
    step = 128 / math.log2(math.e)
    gap = zf.max(dim=1).values - ref.double()
    assert bool((gap >= -step / 2).all()) and bool((gap < step / 2).all()), gap
    k = ref.double() / step
    assert (k - torch.round(k)).abs().max() < 1e-6, k
    expect = torch.exp(zf - ref.double()[:, None])
    # Each W to fp32 rounding of its exponent z * log2(e) (a few ulps of |z| * 1.44, the size of
    # the fp32 logit's own rounding), wherever it is a normal fp32 number.
    normal = expect > 1e-30
    bound = 4 * 2.0**-24 * (2 + 1.5 * zf.abs())
    assert bool(((w.double() - expect).abs() <= bound * expect)[normal].all())
    for row in range(7):
        assert rel_err(s[row].double(), expect[row].sum()) < 2e-6 * (1 + zf[row].abs().max())
    assert zt.tolist()[:4] == [e[0, 0].item(), e[1, 299].item(), e[2, 5].item(), e[3, 7].item()]
    assert zt[4].item() == 0.0 and zt[5].item() == e[5, 41].item() and zt[6].item() == 43.0
    # The caller's targets as they come (here int32), c holding vocabulary rows 1000 .. 1299.
    zt2 = torch.zeros(7, device=device)
    kernels.logits_probs(e, c, None, (targets + 1000).int(), 1000, torch.empty_like(w), zt2, softcap=None,
                         need_zsum=False, config=cfg)
    assert torch.equal(zt2, zt)


def test_fused_gemm_stores_alike_with_and_without_the_copy_engine(device):
    """W goes out through the copy engine when its rows' starts and lengths are 16-byte aligned
    (one_pass pads them), else through the threads' own masked stores: the same bits either way,
    edges clipped (N and V not multiples of the tiles), nothing written past V. (A descriptor of
    101 fp32 columns stored up to column 104 on an H200.)"""
    from cce_parallel import kernels
    from cce_parallel.kernels import probs_gemm

    cfg = kernels.default_config(torch.device(device))
    g = torch.Generator(device).manual_seed(11)
    n, v, d = 37, 100, 32
    e = torch.randn(n, d, device=device, generator=g)
    c = torch.randn(v + 1, d, device=device, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    results = []
    copy_engine = device.type == "cpu" or torch.cuda.get_device_capability(device) >= (9, 0)  # Hopper on
    # Row strides of 416 and 408 bytes; rows of 400 bytes (the copy engine's), then of 404.
    for width, cols, tma in ((104, v, copy_engine), (102, v, False), (104, v + 1, False)):
        buf = torch.full((n, width), -7.0, device=device)
        out = buf[:, :cols]
        assert probs_gemm._tma_usable(e, c[:cols], out) == tma
        zt = torch.zeros(n, device=device)
        ref, s, _, _ = kernels.logits_probs(e, c[:cols], None, targets, 0, out, zt, softcap=None, need_zsum=False,
                                         config=cfg)
        assert bool((buf[:, cols:] == -7.0).all())  # nothing written past V
        results.append((out.clone(), ref, s, zt))
    for got, want in zip(results[0], results[1]):
        assert torch.equal(got, want)
    z = e.double() @ c.double().t()
    assert rel_err(results[0][0].double(), torch.exp(z[:, :v] - results[0][1].double()[:, None])) < 1e-5
    assert rel_err(results[2][0].double(), torch.exp(z - results[2][1].double()[:, None])) < 1e-5


@pytest.mark.parametrize("softcap, z_loss, smoothing", [(None, 0.0, 0.0), (30.0, 1e-3, 0.0), (None, 0.0, 0.1)])
def test_grad_rows_matches_its_pytorch_definition(softcap, z_loss, smoothing, device):
    """kernels.grad_rows against the same arithmetic in PyTorch (fp64): lse, the row factor w, the
    target coefficient B', W's target entry rewritten only where the target is here and p >= 1/2,
    and w E; rows whose reference lies below the ranks' largest (another rank's maximum), rows
    whose target another shard holds, ignored rows (g = 0)."""
    from cce_parallel import kernels

    k, v, d = 37, 50, 24
    g = torch.Generator().manual_seed(7)
    z = torch.randn(k, v, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, v, (k,), generator=g)
    t[::5], t[1::7] = -1, v + 3  # held by another shard
    z[2::3, :].scatter_(1, t.clamp(0, v - 1)[2::3, None], 9.0)  # confident targets (p >= 1/2)
    ref = z.max(dim=1).values
    m = ref + torch.where(torch.arange(k) % 4 == 1, 3.0, 0.0)  # another rank's larger maximum
    s = torch.exp(z - m[:, None]).sum(dim=1) * torch.where(torch.arange(k) % 4 == 1, 1.7, 1.0)
    here = (t >= 0) & (t < v)
    zt = torch.where(here, z.gather(1, t.clamp(0, v - 1)[:, None]).squeeze(1), 0.0)
    gw = torch.rand(k, generator=g, dtype=torch.float64)
    gw[3::6] = 0.0  # ignored tokens
    e = torch.randn(k, d, generator=g)
    f32 = dict(device=device, dtype=torch.float32)
    w_mat = torch.exp(z - ref[:, None]).float().to(device)
    w_got = w_mat.clone()
    lse, w, b = (torch.empty(k, **f32) for _ in range(3))
    we = torch.empty(k, d, **f32)
    kernels.grad_rows(w_got, ref.float().to(device), m.float().to(device), s.float().to(device),
                      zt.float().to(device), gw.float().to(device), t.to(device), lse, w, b, e.to(device), we,
                      softcap=softcap, z_loss=z_loss, label_smoothing=smoothing)

    lse_want = m + torch.log(s)
    a = gw * (1 + 2 * z_loss * lse_want)
    w_want = a * torch.exp(ref - m) / s
    dz = 1 - (zt / softcap) ** 2 if softcap is not None else torch.ones(k, dtype=torch.float64)
    b_want = torch.where(here, gw * (1 - smoothing) * dz, 0.0)
    fold = here & (w_want != 0) & (zt - lse_want >= -math.log(2))
    assert 3 <= int(fold.sum()) < int(here.sum())  # both kinds of rows are tested
    entry = torch.exp(zt - ref) * dz - b_want / torch.where(fold, w_want, 1.0)
    w_want_mat = w_mat.double().cpu().clone()
    rows = torch.arange(k)[fold]
    w_want_mat[rows, t[fold]] = entry[fold]
    assert rel_err(lse.double().cpu(), lse_want) < 1e-6
    assert rel_err(w.double().cpu(), w_want) < 1e-6
    assert rel_err(b.double().cpu(), torch.where(fold, 0.0, b_want)) < 1e-6
    assert torch.allclose(w_got.double().cpu(), w_want_mat, rtol=1e-5, atol=1e-6)
    assert rel_err(we.double().cpu(), e.double() * w_want[:, None]) < 1e-6


def test_grad_rows_brings_rows_a_reference_below_the_ranks_up(device):
    """Under tensor parallelism a rank's reference may lie a whole BUCKET (128 log2 units) below the
    ranks' largest M: its logits stay under 44 nats while another rank's pass them. The gradient's
    factor 2^-128 is no fp32 number on a GPU (its exp flushed it to 0, so that the rank's part of
    the gradient vanished): grad_rows brings such W rows to M by that power of two and makes w =
    A / S. What counts is w W, the logit gradient's part from W, for every row."""
    from cce_parallel import kernels
    from cce_parallel.kernels.probs_gemm import BUCKET

    k, v, d = 8, 300, 16
    g = torch.Generator().manual_seed(9)
    z = torch.randn(k, v, generator=g, dtype=torch.float64) * 2 + 30  # W up to ~e^37 < 2^64
    t = torch.randint(0, v, (k,), generator=g)
    ref = torch.zeros(k, dtype=torch.float64)
    up = torch.arange(k) >= k // 2  # another rank's maximum passes 44 nats: M one BUCKET up
    m = torch.where(up, BUCKET / math.log2(math.e), 0.0)
    s = torch.exp(z - m[:, None]).sum(dim=1) + torch.where(up, 1.0, 0.5)  # plus the other ranks' part
    zt = z.gather(1, t[:, None]).squeeze(1)
    gw = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    e = torch.randn(k, d, generator=g)
    f32 = {"device": device, "dtype": torch.float32}
    w_mat = torch.exp(z - ref[:, None]).float().to(device)
    lse, w, b = (torch.empty(k, **f32) for _ in range(3))
    we = torch.empty(k, d, **f32)
    kernels.grad_rows(w_mat, ref.float().to(device), m.float().to(device), s.float().to(device),
                      zt.float().to(device), gw.float().to(device), t.to(device), lse, w, b, e.to(device), we,
                      softcap=None, z_loss=0.0, label_smoothing=0.0)
    p_want = gw[:, None] * torch.exp(z - m[:, None]) / s[:, None]  # the gradient's part from W
    got = w.double().cpu()[:, None] * w_mat.double().cpu()
    assert rel_err(got[up], p_want[up]) < 1e-5 and rel_err(got[~up], p_want[~up]) < 1e-5
    assert rel_err(lse.double().cpu(), m + torch.log(s)) < 1e-6
    assert rel_err(b.double().cpu(), gw) < 1e-6
    assert rel_err(we.double().cpu(), e.double() * w.double().cpu()[:, None]) < 1e-6


def test_fused_gemm_falls_back_to_tiles_that_fit(device, monkeypatch):
    """Where the configured tiling needs more shared memory than the GPU has, the fused GEMM tries
    fewer pipeline stages, then narrower tiles, gives the same result, and keeps what fit."""
    from dataclasses import replace

    from triton.runtime.errors import OutOfResources

    from cce_parallel import kernels
    from cce_parallel.kernels import probs_gemm

    real, tried = probs_gemm._logits_probs_kernel, []

    class SmallGPU:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tried.append((kwargs["BLOCK_V"], kwargs["num_stages"]))
                if kwargs["BLOCK_V"] > 32 or kwargs["num_stages"] > 2:
                    raise OutOfResources(1 << 20, 1 << 16, "shared memory")
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(probs_gemm, "_logits_probs_kernel", SmallGPU())
    monkeypatch.setattr(probs_gemm, "_FITTING", {})
    cfg = replace(kernels.default_config(torch.device(device)), probs_block_v=64, probs_num_stages=3)
    g = torch.Generator(device).manual_seed(5)
    e = torch.randn(20, 32, device=device, generator=g)
    c = torch.randn(100, 32, device=device, generator=g) * 0.5
    targets = torch.randint(0, 100, (20,), device=device, generator=g)
    for expected in ([(64, 3), (64, 2), (32, 2)], [(32, 2)]):
        tried.clear()
        w, zt = torch.empty(20, 100, device=device), torch.zeros(20, device=device)
        ref, s, _, _ = kernels.logits_probs(e, c, None, targets, 0, w, zt, softcap=None, need_zsum=False, config=cfg)
        assert tried == expected
        z = e.double() @ c.double().t()
        assert rel_err(w.double(), torch.exp(z - ref.double()[:, None])) < 1e-5
        assert rel_err(s.double(), torch.exp(z - ref.double()[:, None]).sum(dim=1)) < 1e-5


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
            for itemsize in (2, 4):
                rows = common.token_block(n, v, budget, itemsize)
                blocks = math.ceil(n / rows)
                assert rows >= 1 and (blocks - 1) * rows < n <= blocks * rows
                assert rows == 1 or rows * v * itemsize <= budget


def _torch_logits_probs(e, c, bias, targets, start, out, zt, *, softcap, need_zsum, config, temperature=1.0,
                        need_pz=False, cap_in_w=True):
    """A PyTorch stand-in for kernels.logits_probs (the interpreter runs Triton in fp32 only)."""
    assert softcap is None and not need_zsum and temperature == 1.0 and not need_pz
    z = e.float() @ c.float().T + (bias.float() if bias is not None else 0.0)
    ref = z.max(dim=1).values
    p = torch.exp(z - ref[:, None])
    out.copy_(p)
    targets = targets.long() - start
    here = (targets >= 0) & (targets < c.shape[0])
    zt.copy_(torch.where(here, z.gather(1, targets.clamp(0, c.shape[0] - 1)[:, None]).squeeze(1), 0.0))
    return ref, p.sum(dim=1), None, None


def _torch_scaled_copy(x, scale, dtype):
    """A PyTorch stand-in for kernels.scaled_copy: the product in fp32, rounded to nearest once."""
    scale = scale.reshape(-1, *[1] * (x.dim() - 1)) if scale.numel() > 1 else scale.reshape(())
    return (x.float() * scale).to(dtype)


def _torch_add_rows_summed(out, index, e, coef):
    """A PyTorch stand-in for kernels.add_rows_summed (bf16 out; indices outside out's rows skipped)."""
    inside = (index >= 0) & (index < out.shape[0])
    rows = e.double()[inside] * coef.double()[inside][:, None]
    out.copy_(out.double().index_add(0, index[inside], rows).to(out.dtype))


def _torch_fold_rows(out, acc, rows, *, back):
    """A PyTorch stand-in for kernels.fold_rows (bf16 out)."""
    for i, r in enumerate(rows.tolist()):
        if r >= 0:
            x = acc[i] + out[r].float()
            if back:
                out[r] = x.to(out.dtype)
            else:
                acc[i], out[r] = x, 0


def _torch_weighted_grads(flag, e, c, bias, targets, lse, a, b, u, scale, dc, db, de=None, *, softcap, add_dc,
                          temperature=1.0, h=None):
    """A PyTorch stand-in for kernels.weighted_grads (bf16 inputs; no bias, softcap, temperature, smoothing or
    entropy)."""
    assert bias is None and softcap is None and u is None and db is None and temperature == 1.0 and h is None
    if not flag.item():
        return
    p = torch.exp(e.float() @ c.float().T - lse[:, None])
    here = (targets >= 0) & (targets < c.shape[0])
    dz = a[:, None] * p
    dz[here.nonzero().squeeze(1), targets[here]] -= b[here]
    g = dz.to(e.dtype).float()
    if dc is not None:
        dc.copy_(((g.T @ e.float()) + (dc.float() if add_dc else 0.0)).to(dc.dtype))
    if de is not None:
        de.copy_((g @ c.float()).to(de.dtype))


def _bf16_stand_ins(device, monkeypatch):
    """On CPU, PyTorch stand-ins replace the fused GEMM, the target rows' kernels, weighted_grads and
    scaled_copy (the interpreter rounds fp32 to bf16 by truncation, a GPU to nearest), and the lean
    path runs its PyTorch reference (the interpreter runs Triton in fp32 only); the rest of the
    one-pass path is the real one."""
    if device.type == "cpu":
        import dataclasses

        from cce_parallel import kernels
        from cce_parallel.ops import functional

        monkeypatch.setattr(kernels, "logits_probs", _torch_logits_probs)
        monkeypatch.setattr(kernels, "add_rows_summed", _torch_add_rows_summed)
        monkeypatch.setattr(kernels, "fold_rows", _torch_fold_rows)
        monkeypatch.setattr(kernels, "weighted_grads", _torch_weighted_grads)
        monkeypatch.setattr(kernels, "scaled_copy", _torch_scaled_copy)
        monkeypatch.setattr(functional, "_triton_usable", lambda impl, device, dtype: True)
        lean_backward, local_stats = autograd.lean_backward, autograd.local_stats
        reference = lambda cfg: dataclasses.replace(cfg, use_triton=False)
        monkeypatch.setattr(autograd, "lean_backward", lambda *a, **k: lean_backward(*a[:-1], reference(a[-1]), **k))
        monkeypatch.setattr(autograd, "local_stats", lambda *a: local_stats(*a[:-1], reference(a[-1])))


def _frequent_target_case(device):
    """bf16 e, c, targets: half the tokens share one target, which the model predicts (p ~ 0.5, as
    for a frequent token of a trained model), so that its GEMM part and target term mostly cancel."""
    n, v, d = 256, 1000, 64
    g = torch.Generator().manual_seed(0)
    e = torch.randn(n, d, generator=g).bfloat16()
    c = (torch.randn(v, d, generator=g) * 0.3).bfloat16()
    t = torch.randint(0, v, (n,), generator=g)
    t[: n // 2] = 7
    t[::7] = -100
    e[: n // 2] += (1.8 * c[7].float()).bfloat16()
    return e.to(device), c.to(device), t.to(device)


def _spy_weighted_grads(monkeypatch):
    """Records the flag of each kernels.weighted_grads launch (1: recomputed)."""
    from cce_parallel import kernels

    flags = []
    real = kernels.weighted_grads
    monkeypatch.setattr(kernels, "weighted_grads",
                        lambda flag, *a, **k: flags.append(int(flag.item())) or real(flag, *a, **k))
    return flags


def _assert_beats_plain_bf16(e, c, t, de, dc, scale):
    """dE and dC of scale * mean cross-entropy (or, for a tensor scale, of the sum of the per-token
    losses times it) closer to float64's than plain bf16 PyTorch's."""

    def loss(x, y):
        if isinstance(scale, torch.Tensor):
            return (torch.nn.functional.cross_entropy(x @ y.T, t, reduction="none") * scale.to(x.dtype)).sum()
        return torch.nn.functional.cross_entropy(x @ y.T, t) * scale

    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    loss(e64, c64).backward()
    e16, c16 = e.clone().requires_grad_(), c.clone().requires_grad_()
    loss(e16, c16).backward()  # plain bf16 PyTorch
    for ours, plain, want in ((de, e16.grad, e64.grad), (dc, c16.grad, c64.grad)):
        assert rel_err(ours.double(), want) < min(5e-3, rel_err(plain.double(), want))


@pytest.mark.parametrize("blocks, main_grad", [(1, False), (2, False), (3, False), (1, True), (2, True)])
def test_bf16_dc_is_summed_in_bf16_with_target_rows_in_fp32(blocks, main_grad, device, monkeypatch):
    """bf16: the dC GEMMs write and then add to a bf16 dC (no V x D fp32 sum); the target rows leave
    it before each later block, are summed in fp32 with their target term and rounded into it once.
    Into Megatron's fp32 main_grad dC goes unrounded. Either way its error is below plain bf16
    PyTorch's, also where one target is most of the tokens (as frequent tokens are) and where
    it cancels most of that row's sum. Stand-ins on CPU (_bf16_stand_ins)."""
    from cce_parallel.ops import functional

    _bf16_stand_ins(device, monkeypatch)
    made = []
    real = autograd.one_pass

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append((out[3].dtype, out[4].dtype))
        return out

    monkeypatch.setattr(autograd, "one_pass", spy)
    e, c, t = _frequent_target_case(device)
    v, n = c.shape[0], t.shape[0]
    budget = 2 * v * (n // blocks)  # bf16 W: n / blocks tokens per block
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    buffer = torch.zeros(c.shape, device=device)
    extra = {"c_main_grad": lambda: buffer} if main_grad else {}
    flags = _spy_weighted_grads(monkeypatch)
    loss = functional.sharded_linear_cross_entropy(e1, c1, t, impl=IMPL, logits_budget=budget, **extra)
    (loss * 4.0).backward()  # an upstream gradient other than 1, a power of two: scaled exactly
    # dE made in bf16 (rounded once, no fp32 dE kept) wherever dC is.
    assert made == [(torch.float32, torch.float32) if main_grad else (torch.bfloat16, torch.bfloat16)]
    assert flags == ([] if main_grad else [0])  # an fp32 dC is not checked; a bf16 one not recomputed
    dc = buffer if main_grad else c1.grad
    assert (c1.grad is None) == main_grad and e1.grad.dtype == torch.bfloat16
    assert dc.dtype == (torch.float32 if main_grad else torch.bfloat16)
    assert rel_err(loss.detach().double(), torch.nn.functional.cross_entropy(e.double() @ c.double().T, t)) < 1e-5
    _assert_beats_plain_bf16(e, c, t, e1.grad, dc, 4.0)


@pytest.mark.parametrize("blocks, reduction, primed", [(1, "mean", False), (2, "mean", False),
                                                       (1, "masked", False), (2, "masked", True)])
def test_bf16_dc_for_an_upstream_number_not_a_power_of_two(blocks, reduction, primed, device, monkeypatch, state):
    """A bf16 dC made in the forward and then scaled by a number that is not a power of two (here
    the loss times 3, as for 3 micro-batches) would be rounded twice: worse than plain bf16
    PyTorch (measured on an H100, docs/accuracy.md). The first backward recomputes it
    (kernels.weighted_grads, flagged on the device) and the host learns the number; the next forward
    makes dC for it, and its backward moves nothing. A power of two scales exactly. Told the number
    beforehand (expect_loss_scale), the first backward moves nothing either."""
    from cce_parallel.ops import functional

    _bf16_stand_ins(device, monkeypatch)
    flags = _spy_weighted_grads(monkeypatch)
    e, c, t = _frequent_target_case(device)
    budget = 2 * c.shape[0] * (t.shape[0] // blocks)
    if primed:
        state.expect_loss_scale(3.0)
    for scale, flag in ((3.0, 0 if primed else 1), (3.0, 0), (6.0, 0), (3.0, 0)):
        e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
        if reduction == "mean":
            loss = functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL, logits_budget=budget)
        else:  # Megatron's loss_mask / count with the mask folded into ignore_index
            per_token = functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL, logits_budget=budget,
                                                                reduction="none")
            loss = per_token.sum() / (t != -100).sum()
        (loss * scale).backward()
        _assert_beats_plain_bf16(e, c, t, e1.grad, c1.grad, scale)
        assert flags[-1] == flag, (scale, flags)
        state.read_reports()  # now, not after the next forward (a GPU host would learn then)
        assert state.loss_scale == 3.0 and not state.loss_scale_unsteady


@pytest.mark.parametrize("known", [False, True])
def test_bf16_gradients_for_per_token_weights_are_recomputed(known, device, monkeypatch, lean_calls, state):
    """Per-token weights on bf16 inputs: dC and dE were made in the forward in bf16 for one weight
    per kept token, so scaling their rows would round them twice. Flagged on the device,
    kernels.weighted_grads recomputes both, within plain bf16 PyTorch's error. The same where the
    host learns of per-token weights between the forward and the backward (known: on a GPU, from
    the call before): that backward makes no host sync either (test_gpu's
    test_no_host_sync_in_a_training_step), and the calls after take the lean path from their
    forward. Stand-ins on CPU (_bf16_stand_ins)."""
    from cce_parallel.ops import functional

    _bf16_stand_ins(device, monkeypatch)
    flags = _spy_weighted_grads(monkeypatch)
    e, c, t = _frequent_target_case(device)
    weights = torch.rand(t.shape, generator=torch.Generator().manual_seed(9)).to(device) + 0.5
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    per_token = functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL, reduction="none")
    if known:
        state.per_token_weights_seen = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (per_token * weights).sum().backward()
    assert (flags, lean_calls) == ([1], [])
    _assert_beats_plain_bf16(e, c, t, e1.grad, c1.grad, weights)


def test_bf16_masked_upstream_recomputes_once_then_corrects_in_fp32(device, monkeypatch, lean_calls, state):
    """Megatron's loss_mask / count with the mask not folded, bf16: the first call's dC and dE were
    rounded to bf16 in the forward, and scaling them by a number that is not a power of two would
    round them twice, so kernels.weighted_grads recomputes both (flagged on the device, no warning)
    and later per-token calls make them in fp32 (masked_weights_seen). The second call's backward
    then subtracts the masked rows' part from the fp32 dC (one more pass on those rows alone) and
    rounds once. Both within plain bf16 PyTorch's error. Stand-ins on CPU (_bf16_stand_ins)."""
    from cce_parallel.ops import functional, reference

    _bf16_stand_ins(device, monkeypatch)
    if device.type == "cpu":  # fp32 logits in the lean backward's reference, as its Triton path has
        logits = reference._logits
        monkeypatch.setattr(reference, "_logits", lambda e, c, *a: logits(e.float(), c.float(), *a))
    made = []
    real = autograd.one_pass
    monkeypatch.setattr(autograd, "one_pass", lambda e, *a, **k: _record(made, e, real(e, *a, **k)))
    flags = _spy_weighted_grads(monkeypatch)
    e, c, t = _frequent_target_case(device)
    mask = (torch.rand(t.shape, generator=torch.Generator().manual_seed(4)) >= 0.2).float().to(device)
    masked_kept = int(((mask == 0) & (t != -100)).sum())
    for call in range(2):
        e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
        per_token = functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ((per_token * mask).sum() / mask.sum() * 3.0).backward()
        state.read_reports()  # now, not after the next forward (a GPU host would learn then)
        assert state.masked_weights_seen and not state.per_token_weights_seen
        if call == 0:
            assert made == [(len(t), torch.bfloat16, torch.bfloat16)] and lean_calls == [] and flags == [1]
        else:
            assert made[1:] == [(len(t), torch.float32, torch.float32), (masked_kept, None, torch.float32)]
            assert flags == [1] and lean_calls == []
        _assert_beats_plain_bf16(e, c, t, e1.grad, c1.grad, mask * (3.0 / mask.sum()))
    # reduction "mean" keeps making them in bf16.
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL).backward()
    assert made[-1] == (len(t), torch.bfloat16, torch.bfloat16)


def _record(made, e, out):
    made.append((e.shape[0], *(t.dtype if t is not None else None for t in out[3:5])))
    return out


def test_bf16_dc_bits_with_a_primed_loss_scale_do_not_depend_on_earlier_calls(device, monkeypatch, state):
    """With expect_loss_scale set (as the train job does), the first call at that scale computes
    the same bits as later ones: a run resumed from a checkpoint matches one that never stopped.
    Unprimed, the first call recomputes dC (other bits, as exact) and the later ones match the
    primed calls (the number learned is 3 exactly here). Replaying the same calls from a fresh
    state gives the same bits."""
    from cce_parallel.ops import functional

    _bf16_stand_ins(device, monkeypatch)
    e, c, t = _frequent_target_case(device)

    def calls(primed):
        state.reset()
        if primed:
            state.expect_loss_scale(3.0)
        grads = []
        for _ in range(3):
            e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
            (functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL) * 3.0).backward()
            state.read_reports()
            grads.append((e1.grad, c1.grad))
        return grads

    primed, unprimed = calls(True), calls(False)
    for de, dc in primed[1:] + unprimed[1:]:
        assert torch.equal(de, primed[0][0]) and torch.equal(dc, primed[0][1])
    assert not torch.equal(unprimed[0][1], primed[0][1])  # the first unprimed dC was recomputed
    again = calls(False)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(again, unprimed))


def test_loss_scales_that_keep_changing_take_the_lean_path(device, monkeypatch, lean_calls, state):
    """Two loss sites with different weights (3, then 5, ...): each backward would recompute dC.
    After two different numbers in a row, bf16-dC calls take the lean path (with a warning): from
    the third call on a CPU, the fourth on a GPU (whose host learns one call late).
    expect_loss_scale ends that."""
    from cce_parallel.ops import functional

    _bf16_stand_ins(device, monkeypatch)
    flags = _spy_weighted_grads(monkeypatch)
    e, c, t = _frequent_target_case(device)
    with warnings.catch_warnings(record=True) as caught:  # learned at the 2nd call (CPU) or 3rd (GPU)
        warnings.simplefilter("always")
        for scale in (3.0, 5.0, 3.0, 5.0):
            e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
            (functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL) * scale).backward()
            _assert_beats_plain_bf16(e, c, t, e1.grad, c1.grad, scale)
    assert [str(w.message) for w in caught if "changed between backwards" in str(w.message)]
    assert state.loss_scale_unsteady
    if device.type == "cuda":
        assert flags == [1, 1, 0] and lean_calls == [True]
    else:
        assert flags == [1, 1] and lean_calls == [True, True]
    # Told the number, the loss takes the one-pass path again (and moves nothing at that number).
    state.expect_loss_scale(3.0)
    assert not state.loss_scale_unsteady
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    (functional.sharded_linear_cross_entropy(e1, c1, t, state=state, impl=IMPL) * 3.0).backward()
    _assert_beats_plain_bf16(e, c, t, e1.grad, c1.grad, 3.0)
    assert flags[-1] == 0 and len(lean_calls) == (1 if device.type == "cuda" else 2)


@pytest.mark.parametrize("how", ["function", "module"])
def test_an_explicit_loss_scale_computes_what_expect_loss_scale_does(how, device, monkeypatch):
    """linear_cross_entropy(..., loss_scale=3) (or LinearCrossEntropy(loss_scale=3)) makes the bf16
    gradients for 3 as a state's expect_loss_scale(3) does: the same bits, no recompute at the first
    backward, within plain bf16 PyTorch's error; and the state's own number stays 1."""
    _bf16_stand_ins(device, monkeypatch)
    flags = _spy_weighted_grads(monkeypatch)
    e, c, t = _frequent_target_case(device)

    def first_call(expect=None, **options):
        if how == "module":
            loss_fn = LinearCrossEntropy(impl=IMPL, **options)
            state = loss_fn.state
        else:
            state = UpstreamState()
            loss_fn = functools.partial(linear_cross_entropy, impl=IMPL, state=state, **options)
        if expect is not None:
            state.expect_loss_scale(expect)
        e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
        (loss_fn(e1, c1, t) * 3.0).backward()
        state.read_reports()
        first_call.state = state
        return e1.grad, c1.grad

    de, dc = first_call(loss_scale=3.0)
    assert first_call.state.loss_scale == 1.0 and flags == [0]
    _assert_beats_plain_bf16(e, c, t, de, dc, 3.0)
    expected = first_call(expect=3.0)
    assert flags == [0, 0] and torch.equal(expected[0], de) and torch.equal(expected[1], dc)
    unprimed = first_call()  # made for 1, then recomputed for 3: other bits
    assert flags[-1] == 1 and not torch.equal(unprimed[1], dc)


def test_an_explicit_loss_scale_is_used_as_given(device, monkeypatch, lean_calls, state):
    """A call given loss_scale makes its gradients for that number, whatever the process-wide
    default says or learns, and takes the one-pass path in an "unsteady" process; a backward that
    brings another number gets exact (recomputed) gradients and a warning, and teaches neither the
    call's number nor the default anything."""
    _bf16_stand_ins(device, monkeypatch)
    flags = _spy_weighted_grads(monkeypatch)
    e, c, t = _frequent_target_case(device)

    def step(upstream_number, **options):
        e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
        (linear_cross_entropy(e1, c1, t, impl=IMPL, state=state, **options) * upstream_number).backward()
        state.read_reports()  # now, not after the next forward (a GPU host would learn then)
        _assert_beats_plain_bf16(e, c, t, e1.grad, c1.grad, upstream_number)
        return flags[-1]

    with pytest.warns(UserWarning, match=r"was 5 .*not the loss_scale=3 it was given"):
        assert step(5.0, loss_scale=3.0) == 1  # recomputed, exact
    assert state.loss_scale == 1.0 and not state._last_missed  # the default learned nothing
    assert step(3.0, loss_scale=3.0) == 0  # still made for 3, not for the 5 its last backward brought
    assert step(3.0) == 1 and state.loss_scale == 3.0  # the default: 1, then learned
    state.expect_loss_scale(5.0)
    assert step(3.0, loss_scale=3.0) == 0  # neither the learned nor the expected default replaces it
    state.loss_scale_unsteady = True  # default calls take the lean path ...
    assert step(3.0, loss_scale=3.0) == 0 and lean_calls == []  # ... a given number the one-pass path
    assert state.loss_scale == 5.0 and state.loss_scale_unsteady


@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf"), True, "1", torch.tensor(0.5)])
def test_expect_loss_scale_rejects_what_is_not_a_finite_nonzero_number(scale, state):
    with pytest.raises(ValueError, match="finite nonzero number"):
        state.expect_loss_scale(scale)


def test_expect_loss_scale_takes_any_real_number(state):
    import numpy as np

    for scale, want in ((np.float32(0.25), 0.25), (3, 3.0), (-0.5, -0.5)):
        state.expect_loss_scale(scale)
        assert state.loss_scale == want and type(state.loss_scale) is float


@pytest.mark.parametrize("blocks", [1, 2])
def test_confident_targets_are_no_worse_than_plain_pytorch(blocks, device, monkeypatch):
    """Where a trained model is sure of the target (here p = 0.99 for most tokens), the logit
    gradient's target entry p - 1 is small beside p: W must not be rounded before the -1 is
    added, or dE and dC lose up to p / (1 - p) times bf16's precision there (they were 1.2x and
    2.5x plain PyTorch's error on an H100 before the target term went into W for such tokens).
    Stand-ins on CPU (_bf16_stand_ins)."""
    from cce_parallel.ops import functional

    _bf16_stand_ins(device, monkeypatch)
    n, v, d = 512, 1000, 64
    g = torch.Generator().manual_seed(3)
    c = (torch.randn(v, d, generator=g) * 0.3).double()
    t = torch.randint(0, 50, (n,), generator=g)  # frequent tokens
    e = torch.randn(n, d, generator=g).double() * 0.5
    # Raise each target's logit to log(0.99 / 0.01) above the log-sum-exp of the others.
    z = e @ c.T
    zt = z.gather(1, t[:, None]).squeeze(1)
    rest = z.scatter(1, t[:, None], float("-inf")).logsumexp(1)
    ct = c[t]
    sure = torch.arange(n) % 8 != 0  # and a few unsure ones
    alpha = torch.where(sure, rest + math.log(99.0) - zt, 0.0)
    e = (e + alpha[:, None] * ct / (ct * ct).sum(1, keepdim=True)).bfloat16()
    c = c.bfloat16()
    e, c, t = e.to(device), c.to(device), t.to(device)
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    loss = functional.sharded_linear_cross_entropy(e1, c1, t, impl=IMPL, logits_budget=2 * v * (n // blocks))
    loss.backward()
    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    torch.nn.functional.cross_entropy(e64 @ c64.T, t).backward()
    p = torch.softmax(e64.detach() @ c64.detach().T, dim=1).gather(1, t[:, None]).squeeze(1)
    assert p[sure.to(device)].min() > 0.9, p[sure.to(device)].min()
    e16, c16 = e.clone().requires_grad_(), c.clone().requires_grad_()
    torch.nn.functional.cross_entropy(e16 @ c16.T, t).backward()  # plain bf16 PyTorch
    for ours, plain, want in ((e1.grad, e16.grad, e64.grad), (c1.grad, c16.grad, c64.grad)):
        assert rel_err(ours.double(), want) < rel_err(plain.double(), want)


def test_target_rows_are_numbered_without_a_sync(device):
    """_TargetRows: the distinct targets in [0, v) numbered in increasing order, each token's number,
    and -1 past the last; targets outside [0, v) (ignored, or in another shard) get -1, which
    kernels.add_rows_summed skips."""
    t = torch.tensor([5, -1, 3, 5, 9, 12, 3, 0, -100, 5], device=device)
    got = one_pass_module._TargetRows(t, 10, 4)
    distinct = [0, 3, 5, 9]
    assert got.rows.tolist() == distinct + [-1] * 6
    for i, x in enumerate(t.tolist()):
        if 0 <= x < 10:
            assert got.slot[i].item() == distinct.index(x)
        else:
            assert got.slot[i].item() == -1
    assert got.acc.shape == (10, 4) and not got.acc.any()
    assert one_pass_module._TargetRows(t, 3, 4).rows.tolist() == [0, -1, -1]  # min(n, v) rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_rows(dtype, device):
    """kernels.fold_rows: out's listed rows move into acc (fp32 sums) and are zeroed, or are set to
    acc + out rounded once; other rows and slots marked -1 are left alone."""
    from cce_parallel import kernels

    if device.type == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter runs Triton in fp32 only")
    g = torch.Generator().manual_seed(2)
    out = torch.randn(30, 40, generator=g).to(dtype).to(device)
    acc = torch.randn(5, 40, generator=g).to(device)
    rows = torch.tensor([4, 29, -1, 0, -1], device=device)
    out0, acc0 = out.clone(), acc.clone()
    kernels.fold_rows(out, acc, rows, back=False)
    listed = [4, 29, 0]
    for i, r in enumerate([4, 29, -1, 0, -1]):
        if r >= 0:
            assert torch.equal(acc[i], acc0[i] + out0[r].float()) and not out[r].any()
        else:
            assert torch.equal(acc[i], acc0[i])
    rest = [r for r in range(30) if r not in listed]
    assert torch.equal(out[rest], out0[rest])
    out[listed] = out0[listed]
    acc1 = acc.clone()
    kernels.fold_rows(out, acc, rows, back=True)
    for i, r in enumerate([4, 29, -1, 0, -1]):
        if r >= 0:
            assert torch.equal(out[r], (acc1[i] + out0[r].float()).to(dtype))
    assert torch.equal(out[rest], out0[rest]) and torch.equal(acc, acc1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_summed_into_a_narrow_tensor(dtype, device):
    """kernels.add_rows_summed: rows that share an index summed in fp32, each row of out rounded
    once more (runs longer than a chunk of the kernel, and rows of out left alone); indices outside
    out's rows (-1 for another shard's target, an ignored token) add nothing, in runs too."""
    from cce_parallel import kernels

    if device.type == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter runs Triton in fp32 only")
    g = torch.Generator().manual_seed(1)
    out = torch.randn(50, 40, generator=g).to(dtype)
    index = torch.randint(0, 50, (400,), generator=g)
    index[:300] = 3
    index[300:310] = 49
    index[310:350] = -1
    index[350:352] = torch.tensor([50, -100])
    e = torch.randn(400, 40, generator=g).to(dtype)
    coef = torch.randn(400, generator=g) * 1e-2
    inside = (index >= 0) & (index < 50)
    want = out.double().index_add(0, index[inside], e.double()[inside] * coef.double()[inside][:, None])
    got = out.clone().to(device)  # a copy on CPU too: out must stay as it was
    kernels.add_rows_summed(got, index.to(device), e.to(device), coef.to(device))
    assert torch.equal(got.cpu(), want.to(dtype)) or rel_err(got.cpu().double(), want) < 1e-6
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[index[inside]] = False
    assert torch.equal(got.cpu()[untouched], out[untouched])


@pytest.mark.parametrize(
    "lengths",
    [
        [64, 64, 64],  # runs that fill chunks exactly (16 positions on a GPU, 64 in the interpreter)
        [15, 1, 17, 31, 33, 1, 63, 65, 127, 129],  # runs that end just before, at and past chunk edges
        [400],  # one index for every row: a run through many chunks
        [1] * 37,  # every index distinct
        [5, 40, 3, 90, 2],
    ],
)
def test_rows_summed_runs_across_chunks(lengths, device):
    """kernels.add_rows_summed sums each run over the chunks it spans, wherever the chunk edges
    fall, with indices to skip among them (-1 sorts first, out.shape[0] and more last); the same
    inputs give the same bits twice."""
    from cce_parallel import kernels

    g = torch.Generator().manual_seed(len(lengths) * 7 + lengths[0])
    v, d = 300, 40
    values = torch.randperm(v, generator=g)[: len(lengths)]
    index = torch.cat([torch.full((n,), int(x)) for n, x in zip(lengths, values)] + [torch.tensor([-1, -1, v, v + 5])])
    index = index[torch.randperm(index.numel(), generator=g)]  # the kernel sorts them
    k = index.numel()
    e = torch.randn(k, d, generator=g)
    coef = torch.randn(k, generator=g)
    out = torch.randn(v, d, generator=g)
    inside = (index >= 0) & (index < v)
    want = out.double().index_add(0, index[inside], e.double()[inside] * coef.double()[inside][:, None])
    runs = []
    for _ in range(2):
        got = out.clone().to(device)  # a copy on CPU too: out must stay as it was
        kernels.add_rows_summed(got, index.to(device), e.to(device), coef.to(device))
        runs.append(got.cpu())
    assert torch.equal(runs[0], runs[1])
    assert rel_err(runs[0].double(), want) < 1e-6
    untouched = torch.ones(v, dtype=torch.bool)
    untouched[index[inside]] = False
    assert torch.equal(runs[0][untouched], out[untouched])


@pytest.mark.parametrize("per_kept", [True, False])
@pytest.mark.parametrize("start, shard", [(0, 20), (5, 7)])
def test_targets_pass_matches_pytorch(start, shard, per_kept, device):
    """kernels.prepare_targets (one launch) against functional.prepare_targets' PyTorch ops: rows in
    the shard, kept tokens (ignore_index inside the vocabulary too), counts, and 1 / kept."""
    from cce_parallel.kernels.targets import prepare_targets as launch
    from cce_parallel.ops.functional import prepare_targets

    g = torch.Generator().manual_seed(2)
    t = torch.randint(-3, 24, (300,), generator=g)  # -3..-1 and 20..23 lie outside [0, 20)
    t[::7] = -100
    for targets, ignore in ((t, -100), (t.to(torch.int32), 4), (torch.full((9,), -100), -100)):
        got = launch(targets.to(device), ignore, 20, start, shard, per_kept)
        want = prepare_targets(targets, ignore, 20, start, shard, per_kept, use_triton=False)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), (a, b)


def test_second_backward_is_a_clear_error(device):
    """The one-pass gradients may be handed out scaled in place: a second backward (retain_graph)
    is refused. The lean path recomputes and gives the same gradients twice."""
    x = inputs(device)
    e = x["e"].detach().requires_grad_()
    loss = linear_cross_entropy(e, x["c"], x["targets"], impl=IMPL)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    lean = linear_cross_entropy(e, x["c"], x["targets"], impl=IMPL, logits_budget="lean")
    first = torch.autograd.grad(lean, e, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(lean, e)[0], first)


@pytest.mark.parametrize("scale", [1.0, 0.375])
def test_scale_in_place(scale, device):
    """kernels.scale_: x *= s with s on the device; s = 1 leaves every bit (NaN payloads too)."""
    from cce_parallel import kernels

    x = torch.randn(70000, generator=torch.Generator().manual_seed(3)).to(device)  # programs loop (CPU: 16,384 a block)
    x[7] = float("nan")
    want = x * scale
    got = kernels.scale_(x.clone(), torch.tensor(scale, device=device))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("per_row", [False, True])
def test_scaled_copy(per_row, device):
    """kernels.scaled_copy: x * s (one number, or one per row) rounded once into another dtype."""
    from cce_parallel import kernels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 300, generator=g)
    s = torch.rand(37 if per_row else 1, generator=g) + 0.5
    want = x.double() * (s.double()[:, None] if per_row else s.double())
    got = kernels.scaled_copy(x.to(device), s.to(device), torch.float32)
    assert got.dtype == torch.float32 and rel_err(got.cpu().double(), want) < 1e-6
    with pytest.raises(ValueError, match="one per row of x"):
        kernels.scaled_copy(x.to(device), torch.ones(36, device=device), torch.float32)


def test_scale_sub_rows(device):
    """kernels.scale_sub_rows: x[i] = w[i] x[i] - b[i] c[index[i]], in place, for shapes that are
    not multiples of the kernel's blocks."""
    from cce_parallel import kernels

    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(37, 70, generator=g), torch.randn(50, 70, generator=g)
    w, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    index = torch.randint(0, 50, (37,), generator=g)
    want = x.double() * w.double()[:, None] - b.double()[:, None] * c.double()[index]
    got = x.to(device)
    kernels.scale_sub_rows(got, w.to(device), b.to(device), c.to(device), index.to(device))
    assert rel_err(got.cpu().double(), want) < 1e-6


def test_scale_sub_rows_into_a_narrower_tensor(device):
    """out = w x - b c[index] rounded once to out's dtype (bf16 out on a GPU, fp32 on CPU: the
    interpreter runs fp32), x left as it was."""
    from cce_parallel import kernels

    g = torch.Generator().manual_seed(5)
    x, c = torch.randn(37, 70, generator=g), torch.randn(50, 70, generator=g)
    w, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    index = torch.randint(-1, 50, (37,), generator=g)
    b[index < 0] = 0.0  # another shard's target: subtracts nothing
    want = x.double() * w.double()[:, None] - b.double()[:, None] * c.double()[index.clamp(0)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x_d = x.to(device)
    out = torch.full((37, 70), 9.0, device=device, dtype=dtype)
    kernels.scale_sub_rows(x_d, w.to(device), b.to(device), c.to(device), index.to(device), out=out)
    assert torch.equal(x_d.cpu(), x)
    assert rel_err(out.cpu().double(), want) < (3e-3 if dtype == torch.bfloat16 else 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        kernels.scale_sub_rows(x_d, w.to(device), b.to(device), c.to(device), index.to(device), out=out[:, :69])


@pytest.mark.parametrize("v, rows_w, tmp", [(300, 304, False), (20, 24, False), (300, 304, True)])
def test_rounded_de_keeps_its_fp32_rows_in_memory_the_block_is_done_with(v, rows_w, tmp, device):
    """one_pass_module._rounded_de: dE = w (W C) - B' C[target] rounded once to the input dtype. Its three
    GEMM parts' fp32 rows go into dE's own memory and W's rows already read (W changes), unless the
    vocabulary is too narrow for that (under about 2 D: an fp32 buffer, W untouched) or the caller
    gives an fp32 buffer (several token blocks: one GEMM, W untouched). bf16 on CPU
    too: the GEMMs are PyTorch's, and the interpreter's bf16 stores truncate (error up to one ulp,
    not half), hence its looser bound."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(6)
    k, d = 40, 16
    buf = torch.rand(k, rows_w, generator=g).to(device=device, dtype=dtype)
    w_mat = buf[:, :v]
    c = torch.randn(v, d, generator=g).to(device=device, dtype=dtype)
    w, b = torch.rand(k, generator=g).to(device), torch.rand(k, generator=g).to(device)
    targets = torch.randint(-1, v, (k,), generator=g).to(device)
    b[targets < 0] = 0.0
    want = (w.double()[:, None] * (w_mat.double() @ c.double())
            - b.double()[:, None] * c.double()[targets.clamp(0)])
    before = buf.clone()
    de = torch.empty(k, d, device=device, dtype=dtype)
    one_pass_module._rounded_de(w_mat, c, w, b, targets, de, torch.empty(k, d, device=device) if tmp else None)
    assert rel_err(de.double(), want) < (3e-3 if device.type == "cuda" else 6e-3)
    assert torch.equal(buf, before) == (v < 2 * d or tmp)


@pytest.mark.parametrize("budget", ["auto", "lean"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_no_tokens(reduction, budget, device):
    """A batch without tokens: an empty (or 0, or NaN for a mean, as in PyTorch) loss, zero gradients."""
    e = torch.randn(0, D, device=device, requires_grad=True)
    c = torch.randn(V, D, device=device, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.long, device=device)
    loss = linear_cross_entropy(e, c, targets, impl=IMPL, reduction=reduction, logits_budget=budget)
    want = torch.nn.functional.cross_entropy(torch.zeros(0, V), torch.zeros(0, dtype=torch.long), reduction=reduction)
    assert loss.shape == want.shape and torch.equal(loss.detach().cpu().isnan(), want.isnan())
    loss.backward(torch.ones_like(loss))
    assert e.grad.shape == (0, D) and torch.count_nonzero(c.grad) == 0


def test_snap_ratio(device):
    """kernels.snap_ratio: a number within 8 ulps of a power of two becomes it (the fp32 quotients of
    a forward's and a backward's scale differ by an ulp or two), any other normal number is off
    (a bf16 dC must be recomputed); 0, subnormals, inf and NaN pass as they are and are not off.
    weighted (per-token weights of a kind other than one number: 1 many, 2 mask) flags and goes into
    the report's code with 4 * off; snap=False passes the number and flags only per-token weights."""
    from cce_parallel import kernels

    one_ulp = 2.0**-23
    cases = [  # ratio, snapped, off
        (1.0, 1.0, 0), (1 + one_ulp, 1.0, 0), (1 - one_ulp / 2, 1.0, 0), (2 - 8 * one_ulp, 2.0, 0),
        (-(2.0**-20) * (1 + 8 * one_ulp), -(2.0**-20), 0), (1 + 9 * one_ulp, 1 + 9 * one_ulp, 1),
        (3.0, 3.0, 1), (-0.37, -0.37, 1), (0.0, 0.0, 0), (1e-40, 1e-40, 0), (float("inf"), float("inf"), 0),
    ]
    for ratio, want, off in cases:
        r = torch.tensor(ratio, device=device)
        for w in (0, 1, 2):
            weighted = torch.tensor([w], device=device, dtype=torch.int32) if w else None
            out, flag, report = kernels.snap_ratio(r, weighted)
            assert out.item() == torch.tensor(want).item() and flag.tolist() == [int(w > 0) | off], (ratio, w)
            assert report.tolist() == [w + 4 * off, out.item()]
        out, flag, report = kernels.snap_ratio(r, None, snap=False)
        assert out.item() == r.item() and flag.tolist() == [0] and report.tolist() == [0.0, r.item()]
    out, flag, _ = kernels.snap_ratio(torch.tensor(float("nan"), device=device))
    assert out.isnan().item() and flag.tolist() == [0]
    with pytest.raises(ValueError, match="one-element fp32"):
        kernels.snap_ratio(torch.ones(2, device=device))


def _weighted_grads_case(device):
    """e [45, 40], c [37, 40], targets in [-1, 37) (-1: held by another rank), a [45] in [0, 1)."""
    g = torch.Generator(device=device).manual_seed(3)
    n, v, d = 45, 37, 40
    e = torch.randn(n, d, generator=g, device=device)
    c = torch.randn(v, d, generator=g, device=device) * 0.3
    targets = torch.randint(-1, v, (n,), generator=g, device=device)
    return e, c, targets, torch.rand(n, generator=g, device=device)


@pytest.mark.parametrize("add", [False, True])
def test_weighted_grads_moves_nothing_unless_flagged(add, device):
    """kernels.weighted_grads against float64: flag 0 leaves dC, dbias and dE as they were (bit for
    bit); flag 1 writes (or, for Megatron's main_grad, adds) dz^T E, writes dz's column sums and
    dz C, with tokens of zero weight in whole blocks skipped and partial tiles at every edge. Each
    output may be asked for alone."""
    from cce_parallel import kernels

    e, c, targets, a = _weighted_grads_case(device)
    n, v, d = e.shape[0], c.shape[0], e.shape[1]
    a[:20] = 0.0  # a whole block of 16 tokens, and some, with no weight
    b = a * 0.9
    z = (e.double() @ c.double().t())
    lse = torch.logsumexp(z, dim=1)
    dz = a.double()[:, None] * torch.exp(z - lse[:, None])
    here = targets >= 0
    dz[here.nonzero().squeeze(1), targets[here]] -= b.double()[here]
    start_dc = torch.randn(v, d, generator=torch.Generator(device=device).manual_seed(4), device=device)
    wants = {"dc": dz.t() @ e.double() + (start_dc.double() if add else 0.0), "db": dz.sum(dim=0),
             "de": dz @ c.double()}
    for flag, asked in ((0, "dc db de"), (1, "dc db de"), (1, "de"), (1, "dc"), (1, "db")):
        out = {"dc": start_dc.clone(), "db": torch.full((v,), 7.0, device=device), "de": torch.full((n, d), 5.0, device=device)}
        kernels.weighted_grads(torch.tensor([flag], device=device, dtype=torch.int32), e, c, None, targets,
                               lse.float(), a, b, None, torch.ones(1, device=device),
                               *(out[k] if k in asked else None for k in ("dc", "db", "de")), softcap=None, add_dc=add)
        untouched = {"dc": start_dc, "db": torch.full((v,), 7.0, device=device), "de": torch.full((n, d), 5.0, device=device)}
        for k, got in out.items():
            if k in asked and flag:
                assert rel_err(got, wants[k]) < 1e-6, k
            else:
                assert torch.equal(got, untouched[k]), k


def test_weighted_grads_retries_smaller_tiles_when_shared_memory_runs_out(device, monkeypatch):
    """The launch is queued on every per-token backward that the device sorts and every backward of
    a bf16 dC or dE, so a GPU with less shared memory than the default tiles need must still run it:
    narrower dC tiles, then one stage, remembered per device and dtype."""
    import importlib

    from triton.runtime.errors import OutOfResources

    from cce_parallel import kernels

    module = importlib.import_module("cce_parallel.kernels.weighted_grads")
    tried = []
    real = module._launch

    def launch(blocks, *args):
        tried.append(blocks)
        if len(tried) == 1:
            raise OutOfResources(1, 0, "shared memory")
        return real(blocks, *args)

    monkeypatch.setattr(module, "_launch", launch)
    monkeypatch.setattr(module, "_FITTING", {})
    e, c, targets, a = _weighted_grads_case(device)
    lse = torch.logsumexp(e @ c.t(), dim=1)
    dc, want = torch.zeros_like(c), torch.zeros_like(c)
    flag = torch.ones(1, device=device, dtype=torch.int32)
    kernels.weighted_grads(flag, e, c, None, targets, lse, a, a, None, torch.ones(1, device=device), dc, None,
                           softcap=None, add_dc=False)
    first = module.CUDA_BLOCKS if device.type == "cuda" else module.CPU_BLOCKS
    assert tried == [first, module._smaller(first)]
    assert module._FITTING == {(e.device, e.dtype): module._smaller(first)}
    assert module._smaller({"BLOCK_D": 64, "num_stages": 2}) == {"BLOCK_D": 32, "num_stages": 2}
    assert module._smaller({"BLOCK_D": 32, "num_stages": 2}) == {"BLOCK_D": 32, "num_stages": 1}
    real(first, flag, e, c, None, targets, lse, a, a, None, None, torch.ones(1, device=device), want, None, None,
         None, 1.0, False)
    assert dc.any() and rel_err(dc, want) < 1e-6  # the smaller tiles compute what the default ones do
    with pytest.raises(OutOfResources):
        module._smaller({"BLOCK_D": 32, "num_stages": 1})
