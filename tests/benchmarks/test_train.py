"""benchmarks/train.py sweep: each impl's sweep stops at its first point that does not train, and
the report names each impl's largest point and the first impl's ratio over it."""

import json
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_sweep_stops_at_the_first_failure_and_reports_the_largest(train, tmp_path, monkeypatch):
    fits = {"cce": 8192, "megatron": 2048}  # the longest sequence each one trains
    tried = []

    def launch(args, impl, seq, mbs):
        tried.append((impl, seq))
        ok = seq <= fits[impl]
        meta = {"device_name": "NVIDIA H200", "layout": {"world": 4, "tp": 1, "dp": 4}, "time": 1.8e9,
                "torch": "2.11", "megatron_core": "0.19.2", "commit": "abc"}
        return {"impl": impl, "seq": seq, "mbs": mbs, "trained": ok, "tokens_per_s": 1000.0 if ok else None,
                "peak_mem_max": 2**30 if ok else None, "why": None if ok else "out of memory", "meta": meta}

    monkeypatch.setattr(train, "sweep_point", launch)
    out = tmp_path / "out"
    assert train.main(["sweep", "--out", str(out), "--work", str(tmp_path / "work"), "--impls", "cce", "megatron",
                       "--seq", "2048", "4096", "8192", "16384"]) == 0
    assert tried == [("cce", 2048), ("cce", 4096), ("cce", 8192), ("cce", 16384), ("megatron", 2048),
                     ("megatron", 4096)]
    (sweep,) = json.loads(next(out.glob("train_sweep_h200x4_*.json")).read_text())["sweeps"]
    assert sweep["largest"] == {"cce": 8192, "megatron": 2048} and sweep["recipe"] == "recipes/gemma-2b-owt.yaml"
    md = next(out.glob("train_sweep_h200x4_*.md")).read_text()
    assert "Largest that trains: cce 8,192; megatron 2,048 (4.00x of it for cce)." in md
    assert "| 4,096 | 1,000 · 1.0 | out of memory |" in md


def test_report_merges_sweeps_and_compares_runs(train, tmp_path):
    """`report` on committed results: the two files of one sequence sweep merge into one series per
    impl with its largest trained point, and the runs' tokens/s and validation loss are compared."""
    results = ROOT / "benchmarks" / "results"
    sweep, layers = results / "train_sweep_h200x4_20261127", results / "gemma2_layers_h200_20261127"
    assert train.main(["report", "--sweeps", str(sweep / "points_1.json"), str(sweep / "points_2.json"),
                       "--runs", str(layers / "plain"), str(layers / "gemma2"), "--warmup", "6",
                       "--out", str(tmp_path), "--name", "r"]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    (sw,) = data["sweeps"]
    assert sw["axis"] == "seq" and sw["largest"] == {"megatron": 65536, "cce_kahan_full_c": None}
    assert [q["seq"] for q in sw["series"]["megatron"]] == [32768, 65536, 131072]
    labels = [r["label"] for r in data["runs"]]
    assert labels == ["cce_kahan_full_c (plain)", "cce_kahan_full_c (gemma2)"]
    md = (tmp_path / "r.md").read_text()
    assert "| 65,536 | 26,536 · 124.5 |" in md and "| cce_kahan_full_c (gemma2) | 22,045 | 0.896 |" in md


def test_sweep_point_counts_a_run_that_logged_every_step_then_failed_as_trained(train, tmp_path, monkeypatch):
    """A launch that trains every step and then exits non-zero (an abort at exit, a timeout in the
    final evaluation) trained: the point says so and keeps the exit; one that stops early did not."""
    args = train.argparse.Namespace(work=str(tmp_path), nproc=4, data_parallel=4, accumulation=1, steps=2, recipe="r.yaml",
                                    launch_timeout=10, extra=[])

    def fake_launch(steps):
        def launch(cmd, *, timeout, log, **kw):
            run_dir = tmp_path / "runs" / next(s.split("=", 1)[1] for s in cmd if s.startswith("run.name="))
            run_dir.mkdir(parents=True, exist_ok=True)
            rows = [{"kind": "meta", "step": 0, "device_name": "NVIDIA H100"}]
            rows += [{"kind": "train", "step": s, "loss": 1.0, "step_time": 1.0, "tokens_per_s": 100.0 * s,
                      "peak_mem_per_rank": [2**30] * 4} for s in range(1, steps + 1)]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            log.write_text("terminate called without an active exception\n")
            return {"exit": 1, "seconds": 1.0}
        return launch

    monkeypatch.setattr(train, "launch", fake_launch(2))
    point = train.sweep_point(args, "megatron", 32768, 1)
    assert (point["trained"], point["exit"], point["tokens_per_s"]) == (True, 1, 200.0)
    monkeypatch.setattr(train, "launch", fake_launch(1))
    point = train.sweep_point(args, "megatron", 65536, 1)
    assert not point["trained"] and point["why"].startswith("exit 1")


def test_compare_counts_a_launch_that_logged_every_step_as_complete(train, tmp_path, monkeypatch):
    """compare's exit status: a launch cut at exit after its last step (status "timeout") is complete;
    one that stopped before its last step is not."""
    work, out = tmp_path / "work", tmp_path / "out"
    args = train.argparse.Namespace(work=str(work), out=str(out), nproc=4, steps=3, gbs=8, mbs=2, lr_warmup=1,
                                    recipe="recipes/gemma-2b-owt.yaml", launch_timeout=10, extra=[])
    logged = {"a": 3, "b": 2}

    def launch(cmd, *, timeout, log, **kw):
        name = next(s.split("=", 1)[1] for s in cmd if s.startswith("run.name="))
        impl = name.rsplit("-", 1)[1]
        (work / "runs" / name).mkdir(parents=True, exist_ok=True)
        rows = [{"kind": "meta", "step": 0}] + [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, logged[impl] + 1)]
        (work / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        log.write_text("")
        return {"exit": "timeout", "seconds": 10.0}

    monkeypatch.setattr(train, "launch", launch)
    monkeypatch.setattr(train.subprocess, "run", lambda *a, **kw: None)  # the data preparation
    args.impls = ["a"]
    runs, rc = train.compare_launch(args)
    assert rc == 0 and [r.name for r in runs] == ["gemma-2b-owt-a"]
    args.impls = ["a", "b"]
    runs, rc = train.compare_launch(args)
    assert rc == 1 and len(runs) == 2


def test_compare_of_committed_runs_reports_tokens_per_s_and_loss_differences(train, tmp_path):
    """`compare --runs` on the committed Gemma 2 2B runs: one report, the others against the first."""
    runs = ROOT / "benchmarks" / "results" / "train_report_h200x4_20261127" / "seed1234"
    impls = ("cce_kahan_full_c", "megatron", "megatron_fused")
    assert train.main(["compare", "--out", str(tmp_path), "--runs", *(str(runs / f"gemma-2b-owt-{i}") for i in impls),
                       "--command", "test"]) == 0
    data = json.loads(next(tmp_path.glob("train_compare_h200_*.json")).read_text())
    assert [r["label"] for r in data["runs"]] == ["cce_kahan_full_c", "megatron", "megatron_fused (native)"]
    assert [c["b"] for c in data["comparisons"]] == ["megatron", "megatron_fused (native)"]
    assert data["comparisons"][0]["steps_compared"] == 300 and abs(data["comparisons"][0]["first_step_diff"]) < 1e-4
    md = next(tmp_path.glob("train_compare_h200_*.md")).read_text()
    assert "| cce_kahan_full_c | 90,312 | 1.110 |" in md and "| megatron | 81,379 | 1.000 |" in md


def test_sweep_global_batch_counts_data_parallel_ranks_only(train, tmp_path, monkeypatch):
    """A sweep point's global batch is micro-batch x data-parallel ranks x accumulation: the Llama
    recipe's tensor 2 on 4 ranks is 2 data-parallel ranks, not 4."""
    llama, gemma = str(ROOT / "recipes/llama-1b-owt.yaml"), str(ROOT / "recipes/gemma-2b-owt.yaml")
    assert train.data_parallel(llama, 4, []) == 2 and train.data_parallel(gemma, 4, []) == 4
    assert train.data_parallel(llama, 4, ["parallel.tensor=4", "model.seq_length=64"]) == 1
    try:
        train.data_parallel(llama, 3, [])
        raise AssertionError("3 ranks at tensor 2 must be refused")
    except SystemExit as err:
        assert "does not divide the world size 3" in str(err)
    seen = []
    monkeypatch.setattr(train, "launch", lambda cmd, **kw: seen.append(cmd) or {"exit": 1, "seconds": 0.0})
    args = train.argparse.Namespace(work=str(tmp_path), nproc=4, data_parallel=train.data_parallel(llama, 4, []),
                                    accumulation=3, steps=2, recipe=llama, launch_timeout=10, extra=[])
    (tmp_path / "llama-s2048-m5.log").write_text("")
    train.sweep_point(args, "llama", 2048, 5)
    assert "train.global_batch_size=30" in seen[0]


def test_report_reads_its_own_json_and_keeps_recipes_apart(train, tmp_path):
    """`report --sweeps` takes a sweep's points.json, an older sweep report ({"points": ...}) and a
    sweep's or report's own JSON ({"sweeps": ...}); sweeps of different recipes stay apart."""

    def points(impl, seqs):
        return [{"impl": impl, "seq": s, "mbs": 1, "trained": s < 4096, "tokens_per_s": 1e3 * s, "peak_mem_max": 2**30,
                 "why": None if s < 4096 else "out of memory"} for s in seqs]

    (tmp_path / "points.json").write_text(json.dumps(points("cce", [1024, 2048, 4096]) + points("megatron", [4096])))
    assert train.main(["report", "--sweeps", str(tmp_path / "points.json"), "--out", str(tmp_path), "--name", "a"]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    a["sweeps"][0]["recipe"] = "recipes/llama-1b-owt.yaml"
    (tmp_path / "a.json").write_text(json.dumps(a))
    older = ROOT / "benchmarks/results/train_sweep_h100x4_20261127/train_sweep_h100x4_20261127.json"
    assert train.main(["report", "--sweeps", str(tmp_path / "a.json"), str(older), "--out", str(tmp_path),
                       "--name", "b"]) == 0
    llama, gemma = json.loads((tmp_path / "b.json").read_text())["sweeps"]
    assert llama["recipe"] == "recipes/llama-1b-owt.yaml" and llama["largest"] == {"cce": 2048, "megatron": None}
    assert [q["seq"] for q in llama["series"]["cce"]] == [1024, 2048, 4096]
    assert gemma["recipe"] == "recipes/gemma-2b-owt.yaml" and gemma["largest"]["cce_kahan_full_c"] == 131072
