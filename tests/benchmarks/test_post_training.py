"""benchmarks/bench_loss.py's post-training objectives (`loss --objectives rl,logprobs,score`, _objectives.py):
the reference is the objective the issue states, a CPU smoke run records every row with sane errors and its
ratios, verl's kernel files load without verl's package, and render_docs.post_training renders a result."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


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


def test_post_training_table_renders_each_objective_per_head(tmp_path, monkeypatch):
    """render_docs.post_training: our plain mean first, then per objective and head ours' ms and its stored
    ratios (over the plain mean; scoring's over our forward), verl's ms and ours over it, torch.compile's ms and
    peak, ours' peak over it, liger's ms; "–" where a row did not run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_docs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def timed(what, ms, mem=None, **ratios):
        return {"status": "ok", what: {"median_ms": ms, "times_ms": [ms] * 4, **ratios}, f"{what}_mem_bytes": mem}

    mib = 1 << 20
    rows = {"rl:ours": {**timed("fwd_bwd", 50.0, 1200 * mib, vs_mean_paired=1.1, vs_verl_paired=0.5),
                        "mem_vs_compile": 0.06},
            "rl:verl": timed("fwd_bwd", 100.0, 1400 * mib), "rl:compile": timed("fwd_bwd", 57.0, 20000 * mib),
            "rl:liger": timed("fwd_bwd", 300.0), "score:ours": timed("fwd", 9.0, vs_fwd_paired=0.8, vs_verl_paired=0.7),
            "score:verl": timed("fwd", 12.0), "fwd:ours": timed("fwd", 11.0)}
    methods = {"ours:cce_kahan_full_c": timed("fwd_bwd", 45.0, 1100 * mib),
               "compile": timed("fwd_bwd", 55.0, 5000 * mib)}
    post = {"temperature": 1.0, "mean_key": "ours:cce_kahan_full_c", "rows": rows}
    case = {"kind": "main", "regime": "trained", "N": 8192, "dtype": "bfloat16", "shape": "gemma2-2b",
            "methods": methods, "post": post}
    meta = {"device": "NVIDIA H200", "git_commit": "0123456789abcdef", "repeats": 4, "rounds": 2,
            "post": {"objectives": {"rl": "", "score": ""}, "temperature": 1.0, "entropy_coef": 0.01,
                     "methods": {"ours": {"impl": "cce_kahan_full_c"}, "verl": {"version": "0.9.1"},
                                 "liger": {"version": "0.8.5", "path": "chunked fallback"}}}}
    (tmp_path / "h200_post.json").write_text(json.dumps({"meta": meta, "cases": [case]}))
    monkeypatch.setattr(render_docs.C, "RESULTS", tmp_path)
    lines = render_docs.post_training("h200_post").splitlines()
    assert lines[0] == render_docs.header("h200_post")
    assert lines[3:6] == [
        "| plain mean, for scale | Gemma 2 2B | 45.0 | – | – | – | 55.0 (5,000 MiB) | 0.220× | – |",
        "| RL objective | Gemma 2 2B | 50.0 | 1.10× | 100.0 | 0.50× | 57.0 (20,000 MiB) | 0.060× | 300.0 |",
        "| scoring, no grad | Gemma 2 2B | 9.00 | 0.80× | 12.0 | 0.70× | – | – | – |",
    ]
    note = " ".join(lines[7:])
    assert "temperature 1" in note and "commit 0123456" in note and "chunked fallback" in note and "0.9.1" in note
