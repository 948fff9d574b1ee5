"""Every generated block of README.md and docs/*.md is what `python -m benchmarks render --docs`
computes from the committed result files: a hand edit of a figure, or a result file changed
without re-rendering, fails here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_blocks_match_the_result_files():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "render", "--docs", "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "up to date" in proc.stdout


def test_a_hand_edit_is_caught():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_docs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = (ROOT / "README.md").read_text()
    rendered, names = render_docs.rewrite(text)
    assert "readme-measured" in names and rendered == text
    edited = text.replace("| time against torch.compile | 0.", "| time against torch.compile | 9.", 1)
    assert edited != text and render_docs.rewrite(edited)[0] == text


def test_calling_patterns_table_gives_each_pattern_over_the_plain_mean_per_shape(tmp_path, monkeypatch):
    """api-calling-patterns: rows are ours' plain mean (its ms), its calling patterns in the run's order (their
    paired ratio over it) and torch.compile (the same); columns the model shapes; a pattern that did not run
    at a shape gets "–", and the path is what most of its calls took."""
    import json
    import statistics

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_docs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    ours = "ours:cce_kahan_full_c"
    plain = [10.0, 10.0, 20.0, 20.0]  # two rounds of two calls, the second round on a clock twice as slow

    def timed(ratio, paths=None):
        times = [ratio * v for v in plain]
        return {"status": "ok", "fwd_bwd": {"median_ms": statistics.median(times), "times_ms": times}, "paths": paths}

    lean = {"checked": 1, "lean": 14, "one_pass": 1, "recomputed": 1}
    gemma = {"compile": timed(1.1), ours: timed(1.0, {"one_pass": 8, "scaled": 8}),
             f"{ours}/fwd_weighted": timed(1.02, {"one_pass": 8, "scaled": 8}), f"{ours}/weighted": timed(1.6, lean)}
    phi = {k: v for k, v in gemma.items() if not k.endswith("/weighted")}  # it did not run there
    case = {"kind": "main", "regime": "trained", "N": 8192, "dtype": "bfloat16"}
    info = {"impl": "cce_kahan_full_c", "upstream": None}
    data = {"meta": {"device": "NVIDIA H200", "git_commit": "0123456789abcdef", "repeats": 4, "rounds": 2,
                     "methods": {"compile": {}, ours: info, f"{ours}/fwd_weighted": {**info, "upstream": "fwd_weighted"},
                                 f"{ours}/weighted": {**info, "upstream": "weighted"}}},
            "cases": [{**case, "shape": "gemma2-2b", "methods": gemma}, {**case, "shape": "phi3.5-mini", "methods": phi},
                      {**case, "shape": "gemma2-2b", "regime": "random", "methods": {}}]}
    (tmp_path / "h200_patterns.json").write_text(json.dumps(data))
    monkeypatch.setattr(render_docs.C, "RESULTS", tmp_path)
    lines = render_docs.api_calling_patterns("h200_patterns").splitlines()
    assert lines[0] == render_docs.header("h200_patterns")
    assert lines[1:7] == [
        "| calling pattern | Gemma 2 2B | Phi 3.5 mini | path |",
        "|---|---|---|---|",
        '| `loss(e, c, t)`, `reduction="mean"` | 15.0 ms | 15.0 ms | one_pass + scaled |',
        '| `loss(e, c, t, weights=r)`, `reduction="mean"` | 1.02× | 1.02× | one_pass + scaled |',
        '| `(loss(e, c, t) * r).sum() / N`, `reduction="none"` | 1.60× | – | lean / – |',
        "| torch.compile of PyTorch's plain mean, for scale | 1.10× | 1.10× | – |",
    ]
    note = " ".join(lines[8:])
    assert "over 2 rounds" in note and "commit 0123456" in note and "N = 8,192 tokens" in note
