"""How far does each loss layer's memory let a real run go: the longest sequence, the largest micro-batch?

One torchrun launch of the recipe per (seq_length, micro_batch) point and loss.impl, up to each
impl's first point that does not train; report OUT/train_sweep_<gpu>x<n>_<yyyymmdd>[_<tag>].{json,md}
(benchmarks/README.md, `sweep`, says what is measured).

    python benchmarks/train_sweep.py --out OUT --seq 4096 8192 16384 32768 65536 131072 --mbs 1 \
        --extra model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1
    python benchmarks/train_sweep.py --out OUT --seq 2048 --mbs 4 8 12 16 24 --tag mbs
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))

import _common as C

from cce_parallel.train.metrics import read_metrics

OOM = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")


def launch(args, impl: str, seq: int, mbs: int) -> dict:
    """One run of the recipe at (seq, mbs): {"trained": bool, "why", tokens/s, peak memory}."""
    name = f"{impl}-s{seq}-m{mbs}"
    work = Path(args.work)
    sets = [f"run.out_dir={work / 'runs'}", f"run.name={name}", "run.seed=1234", "checkpoint.interval=0",
            "checkpoint.resume=never", "checkpoint.at_end=false", "data.source=stdlib", "data.tokenizer=bpe",
            "data.vocab_size=8192", f"data.dir={work / 'data'}", f"model.seq_length={seq}",
            f"train.micro_batch_size={mbs}", f"train.global_batch_size={mbs * args.nproc * args.accumulation}",
            f"train.steps={args.steps}", "optim.warmup_steps=1", "eval.interval=0", "eval.iters=1", "logging.interval=1",
            "logging.wandb=disabled", "loss.softcap=null", f"loss.impl={impl}", *args.extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "cce_parallel.train", "--recipe", args.recipe, "--set", *sets]
    log = work / f"{name}.log"
    print(f"=== {name} ({time.strftime('%H:%M:%S')})", flush=True)
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            status = subprocess.run(cmd, check=False, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.launch_timeout,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    text = log.read_text(errors="replace")
    point = {"impl": impl, "seq": seq, "mbs": mbs, "exit": status, "seconds": time.monotonic() - start}
    metrics = work / "runs" / name / "metrics.jsonl"
    train = read_metrics(metrics)["train"] if metrics.exists() else {}
    steps = sorted(train, key=int)
    point["trained"] = status == 0 and len(steps) == args.steps
    if point["trained"]:
        timed = [train[s] for s in steps[1:]] or [train[s] for s in steps]
        point["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
        peaks = [train[s]["peak_mem_per_rank"] for s in steps if train[s].get("peak_mem_per_rank")]
        point["peak_mem_max"] = max(peaks[-1]) if peaks else None
        point["meta"] = read_metrics(metrics)["meta"][-1]
    else:
        point["why"] = "out of memory" if any(s in text for s in OOM) else \
            "timeout" if status == "timeout" else f"exit {status}: " + " | ".join(text.strip().splitlines()[-3:])[-300:]
    print(f"=== {name}: " + (f"{point['tokens_per_s']:,.0f} tokens/s, peak {(point['peak_mem_max'] or 0) / 2**30:.1f} GiB"
                            if point["trained"] else point["why"]), flush=True)
    return point


def sweep(args) -> list[dict]:
    out = Path(args.out)
    path = out / "points.json"
    points = json.loads(path.read_text()) if path.exists() else []
    for impl in args.impls:
        for seq in args.seq:
            for mbs in args.mbs:
                point = launch(args, impl, seq, mbs)
                points.append(point)
                path.write_text(json.dumps(points, indent=1))
                if not point["trained"]:
                    break
            else:
                continue
            break  # this impl's first failure ends its sweep
    return points


def report(args, points: list[dict]) -> Path:
    meta = next(p["meta"] for p in points if p.get("meta"))
    gpu, world = meta["device_name"], meta["layout"]["world"]
    day = _dt.datetime.fromtimestamp(meta["time"], tz=_dt.timezone.utc).date()
    largest = {}
    for p in points:
        if p["trained"]:
            best = largest.get(p["impl"])
            if best is None or (p["seq"] * p["mbs"], p["seq"]) > (best["seq"] * best["mbs"], best["seq"]):
                largest[p["impl"]] = p
    first = args.impls[0]
    ref = largest.get(first)
    lines = [f"# The largest run each loss layer trains: {args.recipe}, {world}x {gpu}", "",
             (f"- commit {meta.get('commit')}, torch {meta['torch']}, megatron-core {meta['megatron_core']}, "
              f"{day.isoformat()}; tp {meta['layout']['tp']} x dp {meta['layout']['dp']}; loss.softcap null"),
             f"- `python benchmarks/train_sweep.py {' '.join(args.argv)}`", ""]
    rows = [[p["impl"], f"{p['seq']:,}", p["mbs"], "yes" if p["trained"] else p["why"],
             f"{p['tokens_per_s']:,.0f}" if p["trained"] else "",
             f"{(p['peak_mem_max'] or 0) / 2**30:.1f}" if p["trained"] else ""] for p in points]
    lines += C.md_table(["loss.impl", "sequence", "micro-batch", "trained", "tokens/s", "peak memory per rank (GiB)"],
                        rows)
    rows = []
    for impl in args.impls:
        p = largest.get(impl)
        if p is None:
            rows.append([impl, "none trained", "", ""])
            continue
        ratio = f"{ref['seq'] * ref['mbs'] / (p['seq'] * p['mbs']):.2f}" if ref else ""
        rows.append([impl, f"{p['seq']:,} x {p['mbs']}", f"{p['seq'] * p['mbs']:,}", ratio])
    lines += ["", *C.md_table(["loss.impl", "largest (sequence x micro-batch)", "tokens", f"{first}'s tokens over it"],
                              rows)]
    name = f"train_sweep_{C.gpu_slug(gpu)}x{world}_{day.strftime('%Y%m%d')}" + (f"_{args.tag}" if args.tag else "")
    stem = Path(args.out) / name
    summary = {"gpu": gpu, "world": world, "recipe": args.recipe, "commit": meta.get("commit"), "date": day.isoformat(),
               "command": args.argv, "largest": {k: {"seq": v["seq"], "mbs": v["mbs"]} for k, v in largest.items()},
               "points": [{k: v for k, v in p.items() if k != "meta"} for p in points]}
    C.write_report(stem, summary, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return stem


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/cce_train_sweep")
    p.add_argument("--recipe", default="recipes/gemma-2b-owt.yaml")
    p.add_argument("--impls", nargs="+", default=["cce_kahan_full_c", "megatron", "megatron_fused"])
    p.add_argument("--seq", nargs="+", type=int, required=True, help="sequence lengths, in the order to try")
    p.add_argument("--mbs", nargs="+", type=int, default=[1], help="micro-batches, in the order to try (per sequence)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step and rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--launch-timeout", type=float, default=240)
    p.add_argument("--extra", nargs="*", default=[], help="more --set overrides for every run, applied last")
    p.add_argument("--tag", default=None)
    p.add_argument("--report-only", action="store_true", help="render OUT/points.json again")
    args = p.parse_args(argv)
    args.argv = argv
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    points = json.loads((Path(args.out) / "points.json").read_text()) if args.report_only else sweep(args)
    if not any(p["trained"] for p in points):
        print("nothing trained", file=sys.stderr)
        return 1
    report(args, points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
