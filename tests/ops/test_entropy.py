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


def reference(x, options, g_loss, g_entropy):
    """(loss, entropy, [dE, dC, dbias]) in float64 for the objective <g_loss, loss> + <g_entropy, H>."""
    e, c, b = (x[k].detach().double().requires_grad_() for k in ("e", "c", "bias"))
    t = x["targets"].reshape(-1)
    keep = t != options.get("ignore_index", -100)
    z = (e.reshape(-1, D) @ c.T + b) / options.get("temperature", 1.0)
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    loss = torch.nn.functional.cross_entropy(z, torch.where(keep, t, 0), reduction="none",
                                             label_smoothing=options.get("label_smoothing", 0.0))
    loss = torch.where(keep, loss, 0.0)
    entropy = torch.where(keep, torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1), 0.0)
    if options.get("reduction", "mean") == "mean":
        loss = loss.sum() / keep.sum()
    torch.autograd.backward([loss, entropy], [g_loss.double(), g_entropy.reshape(-1).double()])
    return loss.detach(), entropy.detach(), [e.grad, c.grad, b.grad]


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


@pytest.mark.distributed
def test_entropy_under_tensor_parallelism_on_uneven_shards():
    impls = ("torch", "cce_kahan_full_c")
    outcome = spawn(_tp_worker, 2, (impls,), timeout=600.0)
    assert outcome.ok, outcome.describe()
    for name, per_rank in outcome.merged().items():
        for rank, errs in per_rank.items():
            assert all(v < 5 * TOL for v in errs.values()), (name, rank, errs)
