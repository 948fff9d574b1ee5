"""The benchmarks, one CLI: ``python -m benchmarks COMMAND [options]``.

    loss     one GPU: loss + gradients of every peer side by side (``loss --help``)
    tp       under torchrun, TP against Megatron's output path, every TP size of ``--tp 1,2,4`` in
             one launch: ``torchrun --nproc_per_node 4 -m benchmarks tp [options]``
    compare, sweep, report   the train job under torchrun (train.py): loss layers side by side, the
             largest run each loss.impl trains, one report of both
    render   ``--docs [--check]``, no GPU: rewrite (or check) the generated blocks of README.md and
             docs/*.md from the result files they name
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import bench_loss
import bench_tp


def render(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks render")
    p.add_argument("--docs", action="store_true", required=True,
                   help="rewrite the generated blocks of README.md and docs/*.md")
    p.add_argument("--check", action="store_true", help="change nothing, fail where a block differs")
    a = p.parse_args(argv)
    import render_docs

    return render_docs.main(check=a.check)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    commands = {"loss": bench_loss.main, "tp": bench_tp.main, "render": render}
    if argv[0] in commands:
        return commands[argv[0]](argv[1:])
    if argv[0] in ("compare", "sweep", "report"):
        import train

        return train.main(argv)
    raise SystemExit(f"unknown command {argv[0]!r}; known: loss, tp, compare, sweep, report, render")


if __name__ == "__main__":
    sys.exit(main())
