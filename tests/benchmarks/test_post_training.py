"""benchmarks/bench_loss.py's post-training objectives (`loss --objectives rl,logprobs,score`, _objectives.py):
the reference is the objective the issue states, a CPU smoke run records every row with sane errors and its
ratios, and verl's kernel files load without verl's package."""

import json
import sys

import pytest
import torch

@pytest.fixture
def objectives(bench_loss):
    return bench_loss.O


def test_reference_is_the_rl_objective_and_its_gradients_at_a_temperature(objectives):
    """-(logp · adv).mean() - 0.01 · entropy.mean() of softmax(e @ c.T / T), by fp64 autograd, against the
    reference's value, logp, entropy and gradients (a = adv / N, b = -0.01 / N)."""
    N, V, D, T = 24, 37, 8, 0.7
    g = torch.Generator().manual_seed(0)
    e, c = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    e64, c64 = e.double().requires_grad_(True), c.double().requires_grad_(True)
    log_p = torch.log_softmax(e64 @ c64.T / T, dim=-1)
    logp, entropy = log_p.gather(1, t[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)
    adv = objectives.advantages(t).double()
    for name, want in (("rl", -(logp * adv).mean() - 0.01 * entropy.mean()), ("logprobs", -(logp * adv).mean())):
        e64.grad = c64.grad = None
        want.backward(retain_graph=True)
        a, b = objectives.weights(name, t)
        ref = objectives.reference(e, c, t, temperature=T, a=a, b=b)
        assert ref["loss"] == pytest.approx(want.item(), rel=1e-6)
        assert torch.allclose(ref["logp"], logp.detach(), rtol=1e-6)
        assert torch.allclose(ref["entropy"], entropy.detach())
        for got, exp in ((ref["grad_e"], e64.grad), (ref["grad_c"], c64.grad)):
            assert torch.allclose(got.double(), exp, rtol=1e-4, atol=1e-6 * exp.abs().max().item())


def test_a_cpu_smoke_run_measures_each_objective_next_to_the_plain_mean(bench_loss, objectives, tmp_path):
    """`loss --cpu-smoke --objectives rl,logprobs,score` (fp32 on the Triton interpreter, T = 0.7): ours' plain
    mean runs too, every row is recorded (verl and liger unavailable without CUDA), ours' and eager's errors are
    fp32's, and each row's ratios are there: over the plain mean, a score row's over ours' training forward."""
    assert bench_loss.main(["--cpu-smoke", "--objectives", "rl,logprobs,score", "--shapes", "16x67x16",
                            "--regimes", "trained", "--repeats", "2", "--warmup", "0", "--dtype", "fp32",
                            "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    [case] = data["cases"]
    assert list(case["methods"]) == ["ours:cce_kahan_full_c"]  # the plain mean, for the ratios
    assert case["methods"]["ours:cce_kahan_full_c"]["status"] == "ok"
    post = case["post"]
    assert post["temperature"] == 0.7 and data["meta"]["post"]["temperature"] == 0.7
    rows = post["rows"]
    assert list(rows) == [f"{o}:{m}" for o in ("rl", "logprobs", "score") for m in ("ours", "verl", "liger", "eager")
                          ] + ["fwd:ours"]
    for key, r in rows.items():
        if r["method"] in ("verl", "liger"):
            assert r["status"] == "unavailable", r
            continue
        assert r["status"] == "ok", r
        what = "fwd_bwd" if r["objective"] in ("rl", "logprobs") else "fwd"
        assert len(r[what]["times_ms"]) == 2 and r[what]["vs_mean_paired"] > 0, r
        errs = {k: v for k, v in r.items() if k.endswith("_rel_err")}
        assert errs and all(v < 1e-3 for v in errs.values()), r
        if r["objective"] in ("rl", "logprobs"):
            assert {"loss_rel_err", "grad_e_rel_err", "grad_c_rel_err"} <= set(errs), r
        if r["objective"] == "score":
            assert {"logp_rel_err", "entropy_rel_err"} <= set(errs) and r["fwd"]["vs_fwd_paired"] > 0, r
    assert "entropy_rel_err" in rows["rl:ours"] and rows["rl:ours"]["paths"]
    assert rows["fwd:ours"]["loss"] == pytest.approx(case["ref_loss"], rel=1e-4)
    assert set(post["ref"]) == {"rl", "logprobs", "score"}
    assert post["ref"]["rl"]["loss"] != post["ref"]["logprobs"]["loss"]  # the entropy term
    assert "Post-training objectives at T = 0.7" in path.with_suffix(".md").read_text()


def test_without_objectives_a_run_has_no_post_training_rows(bench_loss, tmp_path):
    assert bench_loss.main(["--cpu-smoke", "--shapes", "16x67x16", "--regimes", "random", "--repeats", "1",
                            "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert "post" not in data["meta"] and "post" not in data["cases"][0]
    assert list(data["cases"][0]["methods"]) == ["eager", "ours:torch"]


def test_verl_kernel_files_load_without_its_package(objectives, tmp_path, monkeypatch):
    """load_verl runs verl/utils/kernel/{kernels,linear_cross_entropy}.py, not verl/__init__.py (which imports
    ray and more), with verl.utils.device stubbed while they load, and leaves no verl module behind."""
    kernel = tmp_path / "verl" / "utils" / "kernel"
    kernel.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("raise ImportError('verl/__init__.py ran')\n")
    (kernel / "kernels.py").write_text("from verl.utils.device import get_torch_device, is_cuda_available\n"
                                       "DEVICE = get_torch_device()\n")
    (kernel / "linear_cross_entropy.py").write_text(
        "def linear_cross_entropy(hidden, weight, labels, temperature, reduction):\n"
        "    from . import kernels\n"
        "    return kernels.DEVICE, temperature\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in list(sys.modules):
        if name.startswith(objectives.VERL_PACKAGE):
            monkeypatch.delitem(sys.modules, name)
    package = objectives.load_verl()
    try:
        assert package.linear_cross_entropy.linear_cross_entropy(None, None, None, 0.5, "none") == (torch.cuda, 0.5)
        assert not any(name == "verl" or name.startswith("verl.") for name in sys.modules)
    finally:
        for name in list(sys.modules):
            if name.startswith(objectives.VERL_PACKAGE):
                del sys.modules[name]

