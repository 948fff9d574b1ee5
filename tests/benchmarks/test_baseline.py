"""`python -m benchmarks baseline`: an older cce_parallel imported beside this one, for A/B runs."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git history")
def test_baseline_at_head_imports_beside_this_package_and_agrees(tmp_path):
    import cce_parallel

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common as C
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    path = C.export_baseline("HEAD", tmp_path)
    assert path == tmp_path / f"cce_parallel_{head}"
    sources = [p.read_text() for p in path.rglob("*.py")]
    assert sources and not any("import cce_parallel\n" in s or "from cce_parallel " in s or "from cce_parallel." in s
                               for s in sources)
    base = C.import_baseline(str(path))
    try:
        assert base.__name__ == path.name and base is not cce_parallel
        assert base.linear_cross_entropy.__module__.startswith(path.name)
        g = torch.Generator().manual_seed(0)
        e, c = torch.randn(37, 48, generator=g), torch.randn(517, 48, generator=g)
        t = torch.randint(0, 517, (37,), generator=g)
        ours = cce_parallel.linear_cross_entropy(e, c, t, impl="torch")
        assert torch.equal(base.linear_cross_entropy(e, c, t, impl="torch"), ours)
    finally:
        for name in [m for m in sys.modules if m == path.name or m.startswith(path.name + ".")]:
            del sys.modules[name]
        sys.path.remove(str(tmp_path.resolve()))
    with pytest.raises(SystemExit, match="exists"):
        C.export_baseline("HEAD", tmp_path)
