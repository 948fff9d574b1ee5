"""How does CCE's loss layer compare with megatron-core's in a real pretraining run?

Reads the metrics.jsonl of runs of one recipe that differ in loss.impl (run_train_compare.sh) and
writes ``OUT/train_compare_<gpu>_<yyyymmdd>[_<tag>].{json,md}``: loss curves, tokens/s (median
after --warmup steps), MFU and peak memory per rank; the first run is the one the others are
compared with.

    python benchmarks/train_compare.py --runs OUT/gpt2-small-cce_kahan_full_c OUT/gpt2-small-megatron --out OUT
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _common as C

from cce_parallel.train.metrics import read_metrics


def read_run(run_dir: Path) -> dict:
    """meta (the last start's), train and eval records by step (the last record of each step wins)."""
    m = read_metrics(run_dir / "metrics.jsonl")
    if not m["meta"] or not m["train"]:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no run (meta: {bool(m['meta'])}, steps: {len(m['train'])})")
    return {"dir": str(run_dir), "meta": m["meta"][-1], "train": m["train"], "eval": m["eval"]}


def run_label(meta: dict) -> str:
    """loss.impl, with the fusion megatron_fused ran: megatron-core's cross_entropy_fusion_impl
    (the job's meta ``loss_fusion``; the recipe's loss.fusion_impl where an older run lacks it)."""
    loss = meta["recipe"]["loss"]
    if loss["impl"] != "megatron_fused":
        return loss["impl"]
    return f"megatron_fused ({meta.get('loss_fusion') or loss.get('fusion_impl', '?')})"


def summarize(run: dict, warmup: int) -> dict:
    meta, train = run["meta"], run["train"]
    steps = sorted(train)
    timed = [train[s] for s in steps if s > warmup] or [train[s] for s in steps]
    peaks = [train[s]["peak_mem_per_rank"] for s in steps if train[s].get("peak_mem_per_rank")]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    last_eval = run["eval"][max(run["eval"])] if run["eval"] else None
    tail = [train[s]["loss"] for s in steps[-min(20, len(steps)):]]
    return {
        "label": run_label(meta), "run_dir": run["dir"], "steps": len(steps),
        "tokens_per_step": meta["recipe"]["train"]["global_batch_size"] * meta["recipe"]["model"]["seq_length"],
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_ms_median": 1000 * statistics.median(r["step_time"] for r in timed),
        "mfu_median": statistics.median(mfus) if mfus else None,
        "peak_mem_per_rank": peaks[-1] if peaks else None, "peak_mem_max": max(peaks[-1]) if peaks else None,
        "first_loss": train[steps[0]]["loss"], "final_loss_mean20": sum(tail) / len(tail),
        "final_val_loss": last_eval["val_loss"] if last_eval else None,
        "final_val_ppl": last_eval["val_ppl"] if last_eval else None,
        "params": meta["params_total"], "vocab": meta["vocab_size"], "layout": meta["layout"], "dtype": meta["dtype"],
        "device_name": meta["device_name"], **{k: meta.get(k) for k in ("commit", "command", "torch", "megatron_core")},
    }


def compare_losses(a: dict, b: dict) -> dict:
    common = sorted(set(a["train"]) & set(b["train"]))
    diffs = [a["train"][s]["loss"] - b["train"][s]["loss"] for s in common]
    evals = sorted(set(a["eval"]) & set(b["eval"]))
    return {"steps_compared": len(common), "max_abs_diff": max((abs(d) for d in diffs), default=None),
            "mean_diff_last50": statistics.mean(diffs[-50:]) if diffs else None,
            "first_step_diff": diffs[0] if diffs else None,
            "val_loss_diff": {s: a["eval"][s]["val_loss"] - b["eval"][s]["val_loss"] for s in evals}}


def render_md(data: dict) -> str:
    m, runs, r0 = data["meta"], data["runs"], data["runs"][0]
    lines = [f"# Training with CCE vs megatron-core's loss layer: {m['device']} x {r0['layout']['world']}", "",
             f"{m['date']} · commit `{m['git_commit']}` · torch {r0['torch']} · megatron-core {r0['megatron_core']}", "",
             (f"Model: {r0['params'] / 1e6:.1f}M parameters, vocabulary {r0['vocab']:,} (padded), {r0['dtype']}, layout "
              f"tp {r0['layout']['tp']} x pp {r0['layout']['pp']} x dp {r0['layout']['dp']}, "
              f"{r0['tokens_per_step']:,} tokens/step, {r0['steps']} steps. "
              f"Throughput: median over steps after {data['warmup']}."), ""]
    rows = []
    for r in runs:
        peaks = " / ".join(f"{p / 2**30:.2f}" for p in r["peak_mem_per_rank"]) if r["peak_mem_per_rank"] else "–"
        mfu = f"{100 * r['mfu_median']:.1f}%" if r["mfu_median"] is not None else "–"
        rows.append([r["label"], f"{r['tokens_per_s_median']:,.0f}", f"{r['step_time_ms_median']:.0f}", mfu, peaks,
                     f"{r['first_loss']:.4f}", f"{r['final_loss_mean20']:.4f}", C.fmt_num(r["final_val_loss"], ".4f"),
                     C.fmt_num(r["final_val_ppl"], ".2f")])
    lines += C.md_table(["loss layer", "tokens/s", "ms/step", "MFU", "peak memory per rank (GiB)", "first loss",
                         "last-20 loss", "val loss", "val ppl"], rows)
    for pair in data["comparisons"]:
        c = pair["losses"]
        val = ", ".join(f"step {s}: {d:+.4f}" for s, d in c["val_loss_diff"].items()) or "–"
        lines += ["", (f"{pair['a']} − {pair['b']}: first-step loss difference {C.fmt_num(c['first_step_diff'], '.2e')}, "
                       f"max |difference| over {c['steps_compared']} steps {C.fmt_num(c['max_abs_diff'], '.3f')}, "
                       f"mean difference over the last 50 steps {C.fmt_num(c['mean_diff_last50'], '.4f')}; "
                       f"validation loss differences {val}.")]
    lines += ["", f"Command: `{m['command']}`", "", *(f"- {r['label']}: `{r['command']}`" for r in runs)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", required=True, help="directory for the report")
    ap.add_argument("--tag", help="suffix of the report's file names")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput (default 10)")
    ap.add_argument("--command", help="the command that produced the runs (recorded)")
    args = ap.parse_args(argv)

    runs = [read_run(Path(d)) for d in args.runs]
    summaries = [summarize(r, args.warmup) for r in runs]
    if len({s["label"] for s in summaries}) < len(summaries):  # runs of one impl (an A/B of something else)
        for s, r in zip(summaries, runs):
            s["label"] += f" ({r['meta']['recipe']['run']['name']})"
    device = summaries[0]["device_name"]
    meta = {"device": device, "gpu": C.gpu_slug(device), "git_commit": summaries[0]["commit"] or C.git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": args.command or " ".join([sys.executable, *sys.argv])}
    comparisons = [{"a": summaries[0]["label"], "b": s["label"], "losses": compare_losses(runs[0], r)}
                   for r, s in zip(runs[1:], summaries[1:])]
    data = {"meta": meta, "warmup": args.warmup, "runs": summaries, "comparisons": comparisons}
    day = meta["date"][:10].replace("-", "")
    stem = Path(args.out) / (f"train_compare_{meta['gpu']}_{day}" + (f"_{args.tag}" if args.tag else ""))
    C.write_report(stem, data, render_md(data))
    print(render_md(data))
    print(f"wrote {stem}.{{json,md}}")
    return 0 if all(math.isfinite(s["final_loss_mean20"]) for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
