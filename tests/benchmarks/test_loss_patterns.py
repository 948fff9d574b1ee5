"""benchmarks/bench_loss.py's calling patterns (`ours:<impl>/<pattern>`): each one's loss and gradients
are what UPSTREAMS says, each method owns its LinearCrossEntropy, and a run records the paths taken."""

import json

import pytest
import torch
import torch.nn.functional as F

IMPL = "cce_kahan_full_c"


def expected(pattern: str, per_token: torch.Tensor) -> torch.Tensor:
    """Each pattern's loss from its description, per_token the tokens' cross-entropies, r and mask
    drawn here as UPSTREAMS states them (seed 1; 10 % masked where r < 0.1)."""
    r = torch.rand(per_token.shape, generator=torch.Generator().manual_seed(1)).double()
    mask = (r >= 0.1).double()
    if pattern == "":
        return per_token.mean()
    if pattern == "fwd_weighted":
        return (r * per_token).sum() / r.sum()
    if pattern == "weighted":
        return (r * per_token).sum() / per_token.numel()
    return (mask * per_token).sum() / mask.sum()  # masked, folded, unfolded, fwd_masked


@pytest.mark.interpreter
@pytest.mark.parametrize("pattern", ["", "fwd_weighted", "fwd_masked", "masked", "folded", "unfolded", "weighted"])
def test_each_pattern_computes_the_loss_and_gradients_it_describes(bench_loss, pattern):
    """Two calls (the second on the path the first taught the module), fp32 on the Triton interpreter,
    against the description computed in fp64 with torch."""
    N, V, D = 40, 67, 16
    g = torch.Generator().manual_seed(0)
    e = torch.randn(N, D, generator=g, requires_grad=True)
    c = (torch.randn(V, D, generator=g) * 0.5).requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g)
    e64, c64 = e.detach().double().requires_grad_(True), c.detach().double().requires_grad_(True)
    want = expected(pattern, F.cross_entropy(e64 @ c64.T, t, reduction="none"))
    want.backward()
    assert 0 < (torch.rand(N, generator=torch.Generator().manual_seed(1)) < 0.1).sum() < N  # a mask that drops some

    [method] = bench_loss.build_methods([f"ours:{IMPL}" + (f"/{pattern}" if pattern else "")])
    assert method.unavailable is None, method.unavailable
    fn = method.make()
    for _ in range(2):
        e.grad = c.grad = None
        loss = fn(e, c, t)
        loss.backward()
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
        for got, ref in ((e.grad, e64.grad), (c.grad, c64.grad)):
            assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
    fn.state.read_reports()
    paths = dict(fn.state.paths)
    assert sum(paths.values()) >= 4, paths  # two forwards and two backwards, by name
    assert bench_loss.build_methods([f"ours:{IMPL}"])[0].make().state is not fn.state  # a module per make()


@pytest.mark.interpreter
def test_a_cpu_smoke_run_records_each_patterns_reference_and_paths(bench_loss, tmp_path):
    """`loss --cpu-smoke` with the patterns: every method ran, each pattern's loss is checked against
    the fp32 reference of its own loss, and each ours method's result has the paths its module took."""
    methods = [f"ours:{IMPL}"] + [f"ours:{IMPL}/{p}" for p in bench_loss.UPSTREAMS]
    assert bench_loss.main(["--cpu-smoke", "--shapes", "tiny-a", "--regimes", "trained", "--repeats", "2",
                            "--methods", ",".join(methods), "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*.json")
    [case] = json.loads(path.read_text())["cases"]
    assert list(case["methods"]) == methods
    for key, r in case["methods"].items():
        assert r["status"] == "ok", r
        assert r["loss_rel_err"] < 1e-2 and r["grad_e_rel_err"] < 0.1 and r["grad_c_rel_err"] < 0.1, r
        assert r["paths"] and all(isinstance(n, int) for n in r["paths"].values()), r
    refs = {key.rpartition("/")[2]: r["ref_loss"] for key, r in case["methods"].items() if "/" in key}
    assert refs["fwd_masked"] == refs["masked"] == refs["folded"] == refs["unfolded"]
    assert refs["fwd_weighted"] != refs["weighted"]  # the same r, normalized by Σ r against N
    assert "Paths taken" in path.with_suffix(".md").read_text()
