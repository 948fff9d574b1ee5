"""The package's import graph: no cycles, and the layers point one way.

kernels <- ops <- parallel <- (megatron, train, hf); ops never imports torch.distributed. Every
import counts, those inside functions too: a lazy import hides a cycle from Python, not from a
reader.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cce_parallel"
# A layer may import only itself and the layers listed after it.
LOWER = {
    "kernels": {"kernels"},
    "ops": {"ops", "kernels"},
    "parallel": {"parallel", "ops", "kernels"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(path: Path, mods: dict) -> set[str]:
    """The package modules `path` imports (a package's own __init__ is not counted: importing
    cce_parallel.data.x runs cce_parallel.data first, by Python's rules, not by choice)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in mods else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in mods}


def _graph():
    mods = _modules()
    return {m: {t for t in _imports(p, mods) if t != m and not m.startswith(t + ".")} for m, p in mods.items()}


def test_no_import_cycle():
    graph, done, cycles = _graph(), set(), []

    def visit(module, path):
        for target in sorted(graph[module]):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("layer", sorted(LOWER))
def test_layers_point_one_way(layer):
    graph = _graph()
    bad = []
    for module, targets in graph.items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] != layer:
            continue
        for target in targets:
            sub = target.split(".")
            if len(sub) > 1 and sub[1] not in LOWER[layer]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)


def test_ops_never_imports_torch_distributed():
    for path in (PACKAGE / "ops").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("torch.distributed") for n in names), path
