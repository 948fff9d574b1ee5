"""return_entropy=: each token's entropy H = lse - sum_v p_v z_v of its (tempered, soft-capped)
logits, differentiable, against a float64 reference written here from that definition; on one
device (CPU under the interpreter, or CUDA with CCE_TEST_GPU=1) and over 2 gloo ranks on uneven
vocabulary shards, with and without sequence parallelism (the sum of p z all-reduced with the
statistics, never gathered)."""

import functools

import pytest
import torch
import torch.distributed as dist

import cce_parallel
from tests.dist import spawn
from tests.helpers import random_inputs

V, D, N = 517, 48, 37
TOL = 1e-5


def _float64(x, options):
    """(leaves e, c, bias; targets, keep, z; ce, entropy per token) in float64 on the CPU."""
    e, c, b = (x[k].detach().cpu().double().requires_grad_() for k in ("e", "c", "bias"))
    t = x["targets"].cpu().reshape(-1)
    keep = t != options.get("ignore_index", -100)
    z = (e.reshape(-1, D) @ c.T + b) / options.get("temperature", 1.0)
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    ce = torch.nn.functional.cross_entropy(z, torch.where(keep, t, 0), reduction="none",
                                           label_smoothing=options.get("label_smoothing", 0.0))
    ce = ce + options.get("z_loss", 0.0) * torch.logsumexp(z, -1) ** 2
    entropy = torch.where(keep, torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1), 0.0)
    return (e, c, b), keep, ce, entropy


def reference(x, options, g_loss, g_entropy):
    """(loss, entropy, [dE, dC, dbias]) in float64 for the objective <g_loss, loss> + <g_entropy, H>."""
    leaves, keep, loss, entropy = _float64(x, options)
    loss = torch.where(keep, loss, 0.0)
    if options.get("reduction", "mean") == "mean":
        loss = loss.sum() / keep.sum()
    torch.autograd.backward([loss, entropy], [g_loss.double(), g_entropy.reshape(-1).double()])
    return loss.detach(), entropy.detach(), [t.grad for t in leaves]


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


# Each reaches another path: the one-pass forward (its two-pass variant, whose statistics pass sums
# p z) with softcap and temperature, label smoothing, the lean path, and per-token upstream gradients.
OPTIONS = {
    "softcap-temperature": {"softcap": 3.0, "temperature": 0.7},
    "smoothing-temperature": {"label_smoothing": 0.1, "temperature": 1.4, "reduction": "none"},
    "lean": {"logits_budget": "lean", "reduction": "none", "ignore_index": 3},
}


@pytest.mark.parametrize("used", [False, True], ids=["entropy-logged", "entropy-in-the-objective"])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("impl", ["torch", "cce_kahan_full_c"])
def test_entropy_and_its_gradient_match_float64(impl, name, used, device):
    """The entropy and the loss, and the gradients of loss + (entropy's upstream) * entropy. An
    entropy that only is logged (upstream 0) leaves the forward's gradients in use; one in the
    objective has the backward recompute them (the lean path, exact)."""
    options = OPTIONS[name]
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2,
                      ignore_index=options.get("ignore_index", -100))
    g = torch.Generator().manual_seed(3)
    g_loss = (torch.randn(N, generator=g) if options.get("reduction") == "none" else torch.tensor(1.3)).to(device)
    g_ent = (torch.randn(N, generator=g) if used else torch.zeros(N)).to(device)
    m = cce_parallel.LinearCrossEntropy(impl=impl, return_entropy=True, **options)
    leaves = [x[k].detach().clone().requires_grad_() for k in ("e", "c", "bias")]
    loss, entropy = m(leaves[0], leaves[1], x["targets"], bias=leaves[2])
    assert entropy.dtype == torch.float32 and entropy.shape == x["targets"].shape and entropy.requires_grad
    torch.autograd.backward([loss, entropy], [g_loss, g_ent])
    want_loss, want_ent, want_grads = reference(x, options, g_loss.cpu(), g_ent.cpu())
    assert rel(loss.cpu(), want_loss) < TOL and rel(entropy.cpu(), want_ent) < TOL
    for leaf, want in zip(leaves, want_grads):
        assert rel(leaf.grad.cpu(), want) < 5 * TOL
    backwards = {k for k in m.state.paths if k != "one_pass"}
    if used or impl == "torch" or name == "lean":
        assert backwards == {"lean"}, m.state.paths
    else:
        assert "lean" not in backwards, m.state.paths


def test_forward_only_scoring_gives_logprobs_and_entropy(device):
    """No gradient needed (a rollout's or a reference model's scoring): the forward alone, the
    target log-probs at the temperature as -loss, and the entropy."""
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2)
    m = cce_parallel.LinearCrossEntropy(impl="cce_kahan_full_c", reduction="none", return_entropy=True,
                                        temperature=0.8)
    with torch.no_grad():
        loss, entropy = m(x["e"], x["c"], x["targets"], bias=x["bias"])
    want_loss, want_ent, _ = reference(x, {"temperature": 0.8, "reduction": "none"}, torch.ones(N), torch.zeros(N))
    assert rel(-loss.cpu(), -want_loss) < TOL and rel(entropy.cpu(), want_ent) < TOL
    assert m.state.paths == {"lean": 1} and not loss.requires_grad


def test_return_entropy_must_be_a_bool():
    x = random_inputs((4,), 11, 8, device=torch.device("cpu"))
    with pytest.raises(TypeError, match="^return_entropy must be a bool"):
        cce_parallel.linear_cross_entropy(x["e"], x["c"], x["targets"], return_entropy=1)


def test_entropy_with_lse_returns_both_in_order(device):
    x = random_inputs((N,), V, D, device=device)
    loss, lse, entropy = cce_parallel.linear_cross_entropy(x["e"], x["c"], x["targets"], impl="torch",
                                                           reduction="none", return_lse=True, return_entropy=True)
    assert torch.allclose(lse, torch.logsumexp((x["e"] @ x["c"].T).double(), -1).float(), atol=1e-5)
    assert torch.all(entropy >= 0) and torch.all(entropy <= torch.log(torch.tensor(float(V))) + 1e-5)


RANGES = ((0, 300), (300, V))  # uneven shards


def _tp_worker(rank, world, report, impls):
    group = dist.group.WORLD
    for sp in (False, True):
        for impl in impls:
            name = f"{impl}{'-sp' if sp else ''}"
            report.started(name)
            lead = (N - 1, 2) if sp else (N,)  # sequence parallel: dim 0 split over the ranks
            x = random_inputs(lead, V, D, device=torch.device("cpu"), bias=True, ignore_frac=0.2, seed=7)
            options = {"softcap": 3.0, "temperature": 0.7, "reduction": "none"}
            g = torch.Generator().manual_seed(5)
            g_loss, g_ent = torch.randn(x["targets"].shape, generator=g), torch.randn(x["targets"].shape, generator=g)
            start, stop = RANGES[rank]
            rows = slice(rank * lead[0] // world, (rank + 1) * lead[0] // world) if sp else slice(None)
            leaves = [x["e"][rows], x["c"][start:stop], x["bias"][start:stop]]
            leaves = [t.detach().clone().requires_grad_() for t in leaves]
            fn = functools.partial(cce_parallel.linear_cross_entropy, tp_group=group, vocab_range=(start, stop),
                                   sequence_parallel=sp, impl=impl, return_entropy=True, **options)
            loss, entropy = fn(leaves[0], leaves[1], x["targets"], bias=leaves[2])
            torch.autograd.backward([loss, entropy], [g_loss, g_ent])
            ref = reference(x, options, g_loss.reshape(-1), g_ent.reshape(-1))
            de = ref[2][0].reshape(*lead, D)[rows]
            errs = {"loss": rel(loss.reshape(-1), ref[0]), "entropy": rel(entropy.reshape(-1), ref[1]),
                    "de": rel(leaves[0].grad, de), "dc": rel(leaves[1].grad, ref[2][1][start:stop]),
                    "dbias": rel(leaves[2].grad, ref[2][2][start:stop])}
            report.result(name, errs)
            if impl == "torch":
                continue
            # Entropy weights folded into the one-pass gradients: the statistics all-reduced, the
            # gradients of weights * CE + entropy_weights * H summed.
            name += "-entropy-weights"
            report.started(name)
            weights, ent_w = torch.randn(x["targets"].shape, generator=g), torch.randn(x["targets"].shape, generator=g)
            leaves = [t.detach().clone().requires_grad_() for t in leaves]
            opts = dict(options, reduction="sum")
            loss = fn(leaves[0], leaves[1], x["targets"], bias=leaves[2], weights=weights, entropy_weights=ent_w,
                      reduction="sum", return_entropy=False)
            loss.backward()
            ref = weighted_reference(x, opts, weights, ent_w, torch.tensor(1.0))
            de = ref[2][0].reshape(*lead, D)[rows]
            report.result(name, {"loss": rel(loss, ref[0]), "de": rel(leaves[0].grad, de),
                                 "dc": rel(leaves[1].grad, ref[2][1][start:stop]),
                                 "dbias": rel(leaves[2].grad, ref[2][2][start:stop])})


@pytest.mark.distributed
def test_entropy_under_tensor_parallelism_on_uneven_shards():
    impls = ("torch", "cce_kahan_full_c")
    outcome = spawn(_tp_worker, 2, (impls,), timeout=600.0)
    assert outcome.ok, outcome.describe()
    for name, per_rank in outcome.merged().items():
        for rank, errs in per_rank.items():
            assert all(v < 5 * TOL for v in errs.values()), (name, rank, errs)


# ---------------------------------------------------------------------------------------------
# entropy_weights=: the entropy in the loss, its weights known before the forward.


def weighted_reference(x, options, weights, ent_weights, g_loss):
    """(loss, entropy, [dE, dC, dbias]) in float64 for the loss weights * CE + ent_weights * H per
    kept token, reduced as options say (mean: over the kept count, or the weights' sum)."""
    leaves, keep, ce, entropy = _float64(x, options)
    w = torch.ones_like(ce) if weights is None else weights.reshape(-1).double()
    h = ent_weights.reshape(-1).double() if isinstance(ent_weights, torch.Tensor) else torch.full_like(ce, ent_weights)
    loss = torch.where(keep, w * ce + h * entropy, 0.0)
    reduction = options.get("reduction", "mean")
    if reduction == "mean":
        loss = loss.sum() / (keep.sum() if weights is None else torch.where(keep, w, 0.0).sum())
    elif reduction == "sum":
        loss = loss.sum()
    loss.backward(g_loss.double())
    return loss.detach(), entropy.detach(), [t.grad for t in leaves]


# name: (options, loss weights, entropy weights: "tensor" or a number)
WEIGHTED = {
    "mean-number": ({"temperature": 0.7}, False, -0.3),
    "sum-softcap-weights": ({"softcap": 3.0, "reduction": "sum"}, True, "tensor"),
    "mean-smoothing-zloss": ({"label_smoothing": 0.1, "z_loss": 1e-3}, True, 0.5),
    "softcap-smoothing": ({"softcap": 3.0, "label_smoothing": 0.1, "reduction": "sum"}, False, "tensor"),
}


@pytest.mark.parametrize("name", list(WEIGHTED))
@pytest.mark.parametrize("impl", ["torch", "cce_kahan_full_c"])
def test_entropy_weights_fold_into_the_one_pass(impl, name, device):
    """weights * CE + entropy_weights * H per token, reduced, and its gradients, against float64;
    on the Triton path one forward pass and a backward that only scales its gradients (no
    recompute), the fused GEMM's path and (softcap with label smoothing) its two-pass variant."""
    options, use_w, ent = WEIGHTED[name]
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2)
    g = torch.Generator().manual_seed(9)
    weights = torch.randn(N, generator=g).to(device) if use_w else None
    ent_w = torch.randn(N, generator=g).to(device) if ent == "tensor" else ent
    m = cce_parallel.LinearCrossEntropy(impl=impl, **options)
    leaves = [x[k].detach().clone().requires_grad_() for k in ("e", "c", "bias")]
    loss = m(leaves[0], leaves[1], x["targets"], bias=leaves[2], weights=weights, entropy_weights=ent_w)
    g_loss = torch.tensor(1.7, device=device)
    loss.backward(g_loss)
    want_loss, _, want_grads = weighted_reference(
        x, options, weights.cpu() if weights is not None else None,
        ent_w.cpu() if isinstance(ent_w, torch.Tensor) else ent_w, g_loss.cpu())
    assert rel(loss.cpu(), want_loss) < TOL
    for leaf, want in zip(leaves, want_grads):
        assert rel(leaf.grad.cpu(), want) < 5 * TOL
    if impl != "torch":
        assert dict(m.state.paths) == {"one_pass": 1, "scaled": 1}, m.state.paths


# The backwards of a reduction="none" loss with entropy weights for each upstream gradient's kind:
# name: (state flag, upstream gradient, the backward's path)
BACKWARDS = {
    "checked": (None, "random", "checked"),
    "masked": ("masked_weights_seen", "mask", "mask_corrected"),
    "deferred": ("per_token_weights_seen", "random", "deferred"),
    "recomputed": (None, "mask", "recomputed"),
    "lean": (None, "random+entropy", "lean"),
}


@pytest.mark.parametrize("name", list(BACKWARDS))
def test_entropy_weights_on_every_backward_path(name, device):
    """Per-token upstream gradients of a reduction="none" loss with entropy weights (and loss
    weights, softcap, temperature): each path (the device's check and recompute, a mask's
    correction, dC deferred, a host-side recompute, the lean path for an upstream of the entropy
    too) keeps the entropy's part, against float64."""
    flag, kind, path = BACKWARDS[name]
    options = {"softcap": 3.0, "temperature": 0.8, "reduction": "none"}
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2)
    g = torch.Generator().manual_seed(4)
    weights, ent_w = torch.randn(N, generator=g).to(device), torch.randn(N, generator=g).to(device)
    if kind == "mask":
        g_loss = (torch.rand(N, generator=g) >= 0.3).float().to(device) * 0.25
    else:
        g_loss = torch.randn(N, generator=g).to(device)
    m = cce_parallel.LinearCrossEntropy(impl="cce_kahan_full_c", return_entropy=True, **options)
    if flag:
        setattr(m.state, flag, True)
    leaves = [x[k].detach().clone().requires_grad_() for k in ("e", "c", "bias")]
    loss, entropy = m(leaves[0], leaves[1], x["targets"], bias=leaves[2], weights=weights, entropy_weights=ent_w)
    g_ent = torch.randn(N, generator=g).to(device) if kind == "random+entropy" else torch.zeros(N, device=device)
    torch.autograd.backward([loss, entropy], [g_loss, g_ent])
    # The reference's objective: sum_t g_loss (w CE + h H) + g_ent H.
    want_loss, want_ent, want_grads = weighted_reference(x, options, weights.cpu(), ent_w.cpu(), g_loss.cpu())
    ref = reference(x, options, torch.zeros(N), g_ent.cpu())
    assert rel(loss.cpu(), want_loss) < TOL and rel(entropy.cpu(), want_ent) < TOL
    for leaf, want, extra in zip(leaves, want_grads, ref[2]):
        assert rel(leaf.grad.cpu(), want + extra) < 5 * TOL
    m.state.read_reports()  # on a GPU the device's report of its check arrives one call late
    assert m.state.paths.get(path) == 1, m.state.paths


def test_entropy_weights_gradient_and_errors(device):
    """A tensor of entropy weights that requires grad gets the entropy; bad ones are refused."""
    x = random_inputs((N,), V, D, device=device, ignore_frac=0.2)
    ent_w = torch.randn(N, device=device, requires_grad=True)
    loss, entropy = cce_parallel.linear_cross_entropy(x["e"], x["c"], x["targets"], impl="cce_kahan_full_c",
                                                      reduction="sum", entropy_weights=ent_w, return_entropy=True)
    loss.backward()
    assert torch.allclose(ent_w.grad, entropy.detach())
    for bad, err, match in ((float("nan"), TypeError, "^entropy_weights must be a finite number"),
                            (torch.ones(N, dtype=torch.int64, device=device), TypeError,
                             "^entropy_weights must be a floating"),
                            (torch.ones(N + 1, device=device), ValueError, "^shape mismatch: entropy_weights")):
        with pytest.raises(err, match=match):
            cce_parallel.linear_cross_entropy(x["e"], x["c"], x["targets"], entropy_weights=bad)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at a real shape on trained-model-like data, against float64, no worse than plain bf16
# PyTorch (logits in bf16, then fp32 math) on the same inputs.

GPU_SHAPE = (4096, 50257, 2048)
GPU_OPTIONS = {
    "plain": {},
    "temperature-softcap-ignored": {"temperature": 0.7, "softcap": 30.0},
}


def _objective(x, options, weights, ent_w, logits_dtype):
    """(per-token log-probs, entropy, the objective sum_t w CE + h H, [dE, dC]) with the logits in
    logits_dtype (float64: the oracle; bf16: plain PyTorch, the rest in fp32)."""
    exact = logits_dtype == torch.float64
    e, c = (x[k].detach().double() if exact else x[k].detach() for k in ("e", "c"))
    e, c = e.requires_grad_(), c.requires_grad_()
    t = x["targets"]
    keep = t != -100
    z = (e @ c.T).to(torch.float64 if exact else torch.float32) / options.get("temperature", 1.0)
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    logp = torch.log_softmax(z, -1)
    tok = torch.where(keep, logp.gather(1, torch.where(keep, t, 0)[:, None]).squeeze(1), 0.0)
    entropy = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    loss = (weights.to(tok.dtype) * -tok + ent_w * entropy).sum()
    de, dc = torch.autograd.grad(loss, [e, c])
    return tok.detach(), entropy.detach(), loss.detach(), de, dc


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(GPU_OPTIONS))
def test_gpu_rl_objective_no_worse_than_plain(name, dtype):
    """The RL objective -(logp adv).mean() - 0.01 entropy.mean() folded into one call
    (weights=adv / N, entropy_weights=-0.01 / N, reduction="sum"), and forward-only scoring (the
    log-probs and entropies under no_grad), bf16 and fp16, N=4096, V=50257, D=2048, 10 % ignored in
    the tempered, soft-capped case: each output and gradient against float64 no worse than plain
    PyTorch's in the same dtype (5 % slack). fp16 inputs take the one-pass path's two-pass variant (its fp32 logits, the
    gradient's fp16 scale from the weights); plain PyTorch then computes its logits in fp16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.helpers import peaked_inputs
    from tests.ops.test_gpu import worse_than_plain

    options = GPU_OPTIONS[name]
    n, vocab, dim = GPU_SHAPE
    x = peaked_inputs((n,), vocab, dim, dtype=dtype, device="cuda", n_head=256, n_mid=4096, boost=7.0,
                      n_rare=n // 64)
    g = torch.Generator(device="cuda").manual_seed(2)
    if "softcap" in options:
        x["targets"] = torch.where(torch.rand(n, generator=g, device="cuda") < 0.1, -100, x["targets"])
    adv = torch.randn(n, generator=g, device="cuda")
    weights, ent_w = adv / n, -0.01 / n
    want = _objective(x, options, weights, ent_w, torch.float64)
    plain = _objective(x, options, weights, ent_w, dtype)
    m = cce_parallel.LinearCrossEntropy(impl="cce_kahan_full_c", reduction="sum", return_entropy=True, **options)
    e, c = (x[k].detach().clone().requires_grad_() for k in ("e", "c"))
    loss, entropy = m(e, c, x["targets"], weights=weights, entropy_weights=ent_w)
    loss.backward()
    with torch.no_grad():
        nll, scored = cce_parallel.linear_cross_entropy(x["e"], x["c"], x["targets"], reduction="none",
                                                        return_entropy=True, impl="cce_kahan_full_c", **options)
    ours = {"logp": -nll, "entropy": scored, "loss": loss.detach(), "de": e.grad, "dc": c.grad,
            "entropy_train": entropy.detach()}
    names = ("logp", "entropy", "loss", "de", "dc", "entropy_train")
    refs = dict(zip(names, (want[0], want[1], want[2], want[3], want[4], want[1])))
    base = dict(zip(names, (plain[0], plain[1], plain[2], plain[3], plain[4], plain[1])))
    errs = {k: rel(ours[k], refs[k]) for k in names}
    plain_errs = {k: rel(base[k], refs[k]) for k in names}
    print(f"\n[{name}, {dtype}] error vs fp64 (plain PyTorch in that dtype): "
          + ", ".join(f"{k}={errs[k]:.2e} ({plain_errs[k]:.2e})" for k in names))
    assert dict(m.state.paths) == {"one_pass": 1, "scaled": 1}, m.state.paths
    bad = worse_than_plain(errs, plain_errs)
    assert not bad, (bad, plain_errs)


GPU_RANGES = ((0, 25129), (25129, 50257))  # uneven shards of V = 50257


def _gpu_tp_worker(rank, world, report):
    from tests.helpers import peaked_inputs

    n, vocab, dim = GPU_SHAPE
    options = GPU_OPTIONS["temperature-softcap-ignored"]
    x = peaked_inputs((n,), vocab, dim, dtype=torch.bfloat16, device=f"cuda:{rank}", n_head=256, n_mid=4096,
                      boost=7.0, n_rare=n // 64)
    g = torch.Generator(device=f"cuda:{rank}").manual_seed(2)
    x["targets"] = torch.where(torch.rand(n, generator=g, device=f"cuda:{rank}") < 0.1, -100, x["targets"])
    weights, ent_w = torch.randn(n, generator=g, device=f"cuda:{rank}") / n, -0.01 / n
    want = _objective(x, options, weights, ent_w, torch.float64)
    plain = _objective(x, options, weights, ent_w, torch.bfloat16)
    start, stop = GPU_RANGES[rank]
    for sp in (False, True):
        name = "sp" if sp else "tp"
        report.started(name)
        rows = slice(rank * n // world, (rank + 1) * n // world) if sp else slice(None)
        e = x["e"][rows].detach().clone().requires_grad_()
        c = x["c"][start:stop].detach().clone().requires_grad_()
        call = functools.partial(cce_parallel.linear_cross_entropy, tp_group=dist.group.WORLD,
                                 vocab_range=(start, stop), sequence_parallel=sp, impl="cce_kahan_full_c", **options)
        loss = call(e, c, x["targets"], weights=weights, entropy_weights=ent_w, reduction="sum")
        loss.backward()
        with torch.no_grad():
            nll, entropy = call(x["e"][rows], x["c"][start:stop], x["targets"], reduction="none", return_entropy=True)
        outs = {"logp": -nll, "entropy": entropy, "loss": loss.detach(), "de": e.grad, "dc": c.grad}

        def pick(r):
            return {"logp": r[0], "entropy": r[1], "loss": r[2], "de": r[3][rows], "dc": r[4][start:stop]}

        refs, base = pick(want), pick(plain)
        report.result(name, {"errs": {k: rel(outs[k], refs[k]) for k in outs},
                             "plain": {k: rel(base[k], refs[k]) for k in outs}})


@pytest.mark.gpu
def test_gpu_bf16_rl_objective_tp2():
    """The folded RL objective and forward-only scoring over 2 GPUs on uneven vocabulary shards,
    with and without SP, tempered and soft-capped, 10 % ignored: each rank's outputs and gradient
    shards against float64 no worse than plain bf16 PyTorch's (5 % slack)."""
    from tests.ops.test_gpu import worse_than_plain

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    outcome = spawn(_gpu_tp_worker, 2, backend="nccl", timeout=900.0)
    assert outcome.ok, outcome.describe()
    for name, per_rank in outcome.merged().items():
        for rank, value in sorted(per_rank.items()):
            errs, plain = value["errs"], value["plain"]
            print(f"\n[TP 2 {name}] rank {rank}: " + ", ".join(f"{k}={errs[k]:.2e} ({plain[k]:.2e})" for k in errs))
            assert not worse_than_plain(errs, plain), (name, rank, errs, plain)
