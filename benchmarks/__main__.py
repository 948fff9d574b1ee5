"""The benchmarks, one CLI: ``python -m benchmarks COMMAND [options]``.

    loss     one GPU: loss + gradients of every peer side by side (``loss --help``)
    tp       TP on every visible GPU against Megatron's output path: one torchrun launch of
             bench_tp.py per TP size (``--sizes 1,2,4``, ``--launch-timeout S``), then one merged report
    compare, sweep, report   the train job under torchrun (train.py): loss layers side by side, the
             largest run each loss.impl trains, one report of both
    render   no GPU: merge result files of one kind and rewrite their .md; with
             ``--docs [--check]``, rewrite (or check) the generated blocks of README.md and docs/*.md
    baseline REF DIR   write cce_parallel as it is at git REF to DIR/cce_parallel_<sha>, for
             ``loss --baseline DIR/cce_parallel_<sha> --methods ours:...,base:...``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _common as C
import bench_loss
import bench_tp


def tp(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks tp", add_help=False)
    p.add_argument("--sizes", default="1,2,4", help="TP sizes, one torchrun launch each")
    p.add_argument("--nproc", type=int, default=None, help="ranks per launch (default: every visible GPU)")
    p.add_argument("--launch-timeout", type=float, default=180.0, help="seconds per launch")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default=None, help="suffix of the merged report")
    p.add_argument("-h", "--help", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.help:
        p.print_help()
        print("\nEvery other option goes to each launch of bench_tp.py:\n")
        return bench_tp.main(["--help"])
    if own.nproc is None:
        import torch

        own.nproc = torch.cuda.device_count()
        if own.nproc == 0:
            raise SystemExit("tp: no GPU visible; pass --nproc N with --cpu-smoke to test the plumbing on gloo")
    out = Path(own.out) if own.out else C.RESULTS
    out.mkdir(parents=True, exist_ok=True)
    part, rc = f"{own.tag}-part" if own.tag else "part", 0
    for t in C.csv_list(own.sizes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={own.nproc}",
               str(HERE / "bench_tp.py"), "--tp", t, "--out", str(out), "--tag", f"{part}-tp{t}", *rest]
        print(f"=== TP={t} on {own.nproc} ranks: {' '.join(cmd[2:])}", flush=True)
        try:
            status = subprocess.run(cmd, timeout=own.launch_timeout, check=False,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            status = 124
        if status:
            print(f"=== TP={t} exited with status {status}", file=sys.stderr, flush=True)
            rc = status
    parts = sorted(out.glob(f"*_tp_{part}-tp*.json"))
    if not parts:
        print(f"tp: no results to merge in {out}", file=sys.stderr)
        return rc or 1
    merged = bench_tp.render([str(f) for f in parts], str(out), own.tag)
    for f in parts:  # the merged report replaces the per-launch ones; their .json are its sources
        f.with_suffix(".md").unlink(missing_ok=True)
    return rc or merged


def render(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks render")
    p.add_argument("files", nargs="*", help="result JSONs of one kind (loss or tp) to merge")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default=None)
    p.add_argument("--docs", action="store_true", help="rewrite the generated blocks of README.md and docs/*.md")
    p.add_argument("--check", action="store_true", help="with --docs: change nothing, fail where a block differs")
    a = p.parse_args(argv)
    if a.docs:
        import render_docs

        return render_docs.main(check=a.check)
    if not a.files:
        p.error("pass result files, or --docs")
    kinds = {"tp" if "tp_sizes" in json.loads(Path(f).read_text())["meta"] else "loss" for f in a.files}
    if len(kinds) != 1:
        raise SystemExit("render: pass result files of one kind (loss or tp) at a time")
    return (bench_tp if kinds == {"tp"} else bench_loss).render(a.files, a.out, a.tag)


def baseline(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks baseline")
    p.add_argument("ref", help="a git ref of this checkout")
    p.add_argument("dir", help="folder to write cce_parallel_<sha> into")
    a = p.parse_args(argv)
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    print(C.export_baseline(a.ref, Path(a.dir)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    commands = {"loss": bench_loss.main, "tp": tp, "render": render, "baseline": baseline}
    if argv[0] in commands:
        return commands[argv[0]](argv[1:])
    if argv[0] in ("compare", "sweep", "report"):
        import train

        return train.main(argv)
    raise SystemExit(f"unknown command {argv[0]!r}; known: loss, tp, compare, sweep, report, render, baseline")


if __name__ == "__main__":
    sys.exit(main())
