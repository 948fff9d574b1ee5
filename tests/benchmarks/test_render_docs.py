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
