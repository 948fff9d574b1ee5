"""The train job as a benchmark: torchrun launches of cce_parallel.train, then one report.

    compare     the recipe once per loss.impl on the same data and seed (or runs given with --runs):
                loss curves, tokens/s, MFU and peak memory per rank against the first run
    sweep       per loss.impl, one launch per (seq_length, micro_batch) point up to its first that
                does not train: the largest each one trains
    report      sweeps and one compare setting in one report (JSON, Markdown, PNG with matplotlib)

benchmarks/README.md gives each one's options, what it measures and its CPU smoke test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shutil
import signal
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
# Offline data for every launch: the stdlib text with an 8,192-token BPE (the model keeps the recipe's vocabulary).
DATA = ["data.source=stdlib", "data.tokenizer=bpe", "data.vocab_size=8192"]


# ---- Shared: launch, read, report ----------------------------------------------------------------


def torchrun(nproc: int, recipe: str, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "cce_parallel.train", "--recipe", recipe, "--set", *sets]


def launch(cmd: list[str], *, timeout: float, log: Path) -> dict:
    """One launch, output to `log`, its process group SIGKILLed after `timeout` s (exit "timeout").
    Returns {exit, seconds}."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            if proc.poll() is None:  # the workers too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"exit": status, "seconds": time.monotonic() - start}


def throughput(train: dict, warmup: int) -> dict:
    """Medians over the steps after `warmup` (over all where none is), and the last peak memory per rank."""
    steps = sorted(train)
    timed = [train[s] for s in steps if s > warmup] or [train[s] for s in steps]
    peaks = [train[s]["peak_mem_per_rank"] for s in steps if train[s].get("peak_mem_per_rank")]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
            "step_time_ms_median": 1000 * statistics.median(r["step_time"] for r in timed),
            "mfu_median": statistics.median(mfus) if mfus else None,
            "peak_mem_per_rank": peaks[-1] if peaks else None, "peak_mem_max": max(peaks[-1]) if peaks else None}


def write(stem: Path, data: dict) -> None:
    """stem.json, stem.md and (with matplotlib) stem.png of report_data's data."""
    markdown = report_md(data)
    C.write_report(stem, data, markdown)
    if not report_png(data, stem.with_suffix(".png")):
        print("matplotlib unavailable: no PNG written")
    print(markdown)


def launch_parser(command: str, *, work: str, recipe: str, nproc: int, steps: int, timeout: float, **kw):
    """The options of a command that launches the train job."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {command}", **kw)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--work", default=work, help="runs, data and checkpoints")
    p.add_argument("--recipe", default=recipe)
    p.add_argument("--nproc", type=int, default=nproc, help="ranks per launch")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--launch-timeout", type=float, default=timeout, help="seconds per launch")
    p.add_argument("--extra", nargs="*", default=[], help="more --set overrides for every run, applied last")
    p.add_argument("--impls", nargs="+", default=["cce_kahan_full_c", "megatron", "megatron_fused"],
                   help="loss.impl of each run; the first is the one the others are compared with")
    p.add_argument("--tag", help="suffix of the report's file names")
    return p


# ---- compare: runs of one recipe that differ in loss.impl ----------------------------------------


def run_label(meta: dict) -> str:
    """loss.impl, with the fusion megatron_fused ran: megatron-core's cross_entropy_fusion_impl
    (the job's meta ``loss_fusion``; the recipe's loss.fusion_impl where an older run lacks it)."""
    loss = meta["recipe"]["loss"]
    if loss["impl"] != "megatron_fused":
        return loss["impl"]
    return f"megatron_fused ({meta.get('loss_fusion') or loss.get('fusion_impl', '?')})"


def summarize(run_dir: Path, warmup: int) -> dict:
    """A run's figures and loss curves, from its metrics.jsonl (the last start's meta; the last record of a step)."""
    m = read_metrics(run_dir / "metrics.jsonl")
    if not m["meta"] or not m["train"]:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no run (meta: {bool(m['meta'])}, steps: {len(m['train'])})")
    meta, train, evals = m["meta"][-1], m["train"], m["eval"]
    steps = sorted(train)
    last_eval = evals[max(evals)] if evals else None
    tail = [train[s]["loss"] for s in steps[-min(20, len(steps)):]]
    return {
        "label": run_label(meta), "run_name": meta["recipe"]["run"]["name"], "run_dir": str(run_dir), "steps": len(steps),
        "tokens_per_step": meta["recipe"]["train"]["global_batch_size"] * meta["recipe"]["model"]["seq_length"],
        "seq_length": meta["recipe"]["model"]["seq_length"], "micro_batch_size": meta["recipe"]["train"]["micro_batch_size"],
        **throughput(train, warmup),
        "first_loss": train[steps[0]]["loss"], "final_loss_mean20": sum(tail) / len(tail),
        "final_val_loss": last_eval["val_loss"] if last_eval else None,
        "final_val_ppl": last_eval["val_ppl"] if last_eval else None,
        "params": meta["params_total"], "vocab": meta["vocab_size"], "layout": meta["layout"], "dtype": meta["dtype"],
        "device_name": meta["device_name"], **{k: meta.get(k) for k in ("commit", "command", "torch", "megatron_core")},
        "train_curve": [[s, r["loss"]] for s, r in sorted(train.items())],
        "val_curve": [[s, r["val_loss"]] for s, r in sorted(evals.items())],
    }


def compare_losses(a: dict, b: dict) -> dict:
    """b's loss curves against a's (two summaries of report_data)."""
    (ta, va), (tb, vb) = ((dict(r["train_curve"]), dict(r["val_curve"])) for r in (a, b))
    diffs = [ta[s] - tb[s] for s in sorted(set(ta) & set(tb))]
    return {"a": a["label"], "b": b["label"], "steps_compared": len(diffs),
            "max_abs_diff": max((abs(d) for d in diffs), default=None),
            "mean_diff_last50": statistics.mean(diffs[-50:]) if diffs else None,
            "first_step_diff": diffs[0] if diffs else None,
            "val_loss_diff": {s: va[s] - vb[s] for s in sorted(set(va) & set(vb))}}


def compare_launch(args) -> tuple[list[Path], int]:
    """The recipe once per --impls (tp and dp as the recipe and --nproc give), on the same data and
    seed, each one torchrun launch killed after --launch-timeout s; runs, data and checkpoints in
    --work. OUT/<recipe>-<impl> gets each run's metrics.jsonl, recipe.yaml and train.log. Returns the
    runs and 1 when one of them logged fewer than --steps steps, else 0."""
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    sets = [f"run.out_dir={work / 'runs'}", "run.seed=1234", *DATA, f"data.dir={work / 'data' / 'stdlib-bpe-8192'}",
            f"train.steps={args.steps}", f"train.global_batch_size={args.gbs}", f"train.micro_batch_size={args.mbs}",
            f"optim.warmup_steps={args.lr_warmup}", "eval.interval=100", "eval.iters=4", "checkpoint.interval=0",
            "checkpoint.at_end=false", "checkpoint.resume=never", "logging.interval=10", "logging.wandb=disabled",
            *args.extra]
    subprocess.run([sys.executable, "-m", "cce_parallel.train", "--recipe", args.recipe, "--prepare-data", "--set",
                    *sets], cwd=ROOT, check=True)  # tokenizer and tokens, once, before any launch
    rc, runs = 0, []
    for impl in args.impls:
        name = f"{Path(args.recipe).stem}-{impl}"
        shutil.rmtree(work / "runs" / name, ignore_errors=True)
        (out / name).mkdir(parents=True, exist_ok=True)
        print(f"=== loss.impl={impl} on {args.nproc} ranks ({time.strftime('%H:%M:%S')})", flush=True)
        cmd = torchrun(args.nproc, args.recipe, [*sets, f"loss.impl={impl}", f"run.name={name}"])
        status = launch(cmd, timeout=args.launch_timeout, log=out / name / "train.log")["exit"]
        for f in ("metrics.jsonl", "recipe.yaml"):
            if (work / "runs" / name / f).exists():
                shutil.copy(work / "runs" / name / f, out / name / f)
        logged = len(read_metrics(out / name / "metrics.jsonl")["train"]) if (out / name / "metrics.jsonl").exists() else 0
        if status != 0:  # a run that logged every step is complete (e.g. cut by the timeout while exiting)
            print(f"=== loss.impl={impl}: {logged} of {args.steps} steps logged, then exit status {status} "
                  f"(log: {out / name / 'train.log'})", flush=True)
            rc = rc or int(logged < args.steps)
        if (out / name / "metrics.jsonl").exists():
            runs.append(out / name)
    return runs, rc


def compare(argv: list[str]) -> int:
    ap = launch_parser("compare", work="/tmp/cce_train_compare", recipe="recipes/gpt2-small-owt.yaml", nproc=4,
                       steps=300, timeout=240, description="loss layers side by side in the train job; exit status "
                       "0 when every run and the report succeeded")
    ap.add_argument("--runs", nargs="+", help="run directories (each with metrics.jsonl) to compare instead of launching")
    ap.add_argument("--gbs", type=int, default=64, help="train.global_batch_size")
    ap.add_argument("--mbs", type=int, default=8, help="train.micro_batch_size")
    ap.add_argument("--lr-warmup", type=int, default=30, help="optim.warmup_steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput (default 10)")
    ap.add_argument("--command", help="the command that produced the runs (recorded)")
    args = ap.parse_args(argv)

    rc = 0
    if args.runs is None:
        args.runs, rc = compare_launch(args)
    data = report_data([], [Path(d) for d in args.runs], args.warmup)
    device = data["gpu"]
    data["meta"] = {"device": device, "git_commit": data["runs"][0]["commit"] or C.git_commit(), "date": C.utc_now(),
                    "command": args.command or " ".join([sys.executable, *sys.argv])}
    day = data["meta"]["date"][:10].replace("-", "")
    write(Path(args.out) / (f"train_compare_{C.gpu_slug(device)}_{day}" + (f"_{args.tag}" if args.tag else "")), data)
    return rc or int(not all(math.isfinite(r["final_loss_mean20"]) for r in data["runs"]))


# ---- sweep: the largest run each loss.impl trains ------------------------------------------------


def sweep_point(args, impl: str, seq: int, mbs: int) -> dict:
    """One run of the recipe at (seq, mbs): {"trained": bool, "why", tokens/s, peak memory}."""
    name, work = f"{impl}-s{seq}-m{mbs}", Path(args.work)
    sets = [f"run.out_dir={work / 'runs'}", f"run.name={name}", "run.seed=1234", "checkpoint.interval=0",
            "checkpoint.resume=never", "checkpoint.at_end=false", *DATA, f"data.dir={work / 'data'}",
            f"model.seq_length={seq}", f"train.micro_batch_size={mbs}",
            f"train.global_batch_size={mbs * args.data_parallel * args.accumulation}", f"train.steps={args.steps}",
            "optim.warmup_steps=1", "eval.interval=0", "eval.iters=1", "logging.interval=1", "logging.wandb=disabled",
            "loss.softcap=null", f"loss.impl={impl}", *args.extra]
    log = work / f"{name}.log"
    print(f"=== {name} ({time.strftime('%H:%M:%S')})", flush=True)
    run = launch(torchrun(args.nproc, args.recipe, sets), timeout=args.launch_timeout, log=log)
    point = {"impl": impl, "seq": seq, "mbs": mbs, "exit": run["exit"], "seconds": run["seconds"]}
    path = work / "runs" / name / "metrics.jsonl"
    metrics = read_metrics(path) if path.exists() else None
    train = metrics["train"] if metrics else {}
    # Trained: every step logged. A launch that then fails (e.g. an abort at exit) keeps its exit code.
    point["trained"] = len(train) == args.steps
    if point["trained"]:
        measured = throughput(train, warmup=min(train))  # the steps after the first
        point.update(tokens_per_s=measured["tokens_per_s_median"], peak_mem_max=measured["peak_mem_max"],
                     meta=metrics["meta"][-1])
    else:
        text = log.read_text(errors="replace")
        point["why"] = "out of memory" if any(s in text for s in OOM) else "timeout" if run["exit"] == "timeout" \
            else f"exit {run['exit']}: " + " | ".join(text.strip().splitlines()[-3:])[-300:]
    print(f"=== {name}: " + (f"{point['tokens_per_s']:,.0f} tokens/s, peak {(point['peak_mem_max'] or 0) / 2**30:.1f} GiB"
                            if point["trained"] else point["why"]), flush=True)
    return point


def data_parallel(recipe: str, nproc: int, extra: list[str]) -> int:
    """The data-parallel ranks of an --nproc launch of the recipe (with --extra), as the train job counts them."""
    from cce_parallel.config import RecipeError
    from cce_parallel.config.loader import load_recipe

    try:
        return load_recipe(recipe, extra).data_parallel_size(nproc)
    except RecipeError as err:
        raise SystemExit(f"--nproc {nproc}: {err}") from None


def sweep_points(args) -> list[dict]:
    """Every impl's points in order, up to its first that does not train; OUT/points.json after each."""
    path = Path(args.out) / "points.json"
    points = json.loads(path.read_text()) if path.exists() else []
    for impl in args.impls:
        for seq in args.seq:
            for mbs in args.mbs:
                points.append(sweep_point(args, impl, seq, mbs))
                path.write_text(json.dumps(points, indent=1))
                if not points[-1]["trained"]:
                    break
            if not points[-1]["trained"]:
                break
    return points


def sweep_report(args, points: list[dict]) -> None:
    """OUT/train_sweep_<gpu>x<world>_<date>.{json,md,png}: the report of OUT/points.json."""
    meta = next(p["meta"] for p in points if p.get("meta"))
    gpu, world = meta["device_name"], meta["layout"]["world"]
    day = _dt.datetime.fromtimestamp(meta["time"], tz=_dt.timezone.utc).date()  # the run's, not the report's
    data = report_data([Path(args.out) / "points.json"], [], 0)
    data["sweeps"][0].update(recipe=args.recipe, gpu=gpu, world=world, commit=meta.get("commit"), command=args.argv)
    data["gpu"] = gpu
    write(Path(args.out) / (f"train_sweep_{C.gpu_slug(gpu)}x{world}_{day.strftime('%Y%m%d')}"
                            + (f"_{args.tag}" if args.tag else "")), data)


def sweep(argv: list[str]) -> int:
    p = launch_parser("sweep", work="/tmp/cce_train_sweep", recipe="recipes/gemma-2b-owt.yaml", nproc=4, steps=4,
                      timeout=240)
    p.add_argument("--seq", nargs="+", type=int, required=True, help="sequence lengths, in the order to try")
    p.add_argument("--mbs", nargs="+", type=int, default=[1], help="micro-batches, in the order to try (per sequence)")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step and rank")
    p.add_argument("--report-only", action="store_true", help="render OUT/points.json again")
    args = p.parse_args(argv)
    args.argv = argv
    args.data_parallel = data_parallel(args.recipe, args.nproc, args.extra)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    points = json.loads((Path(args.out) / "points.json").read_text()) if args.report_only else sweep_points(args)
    if not any(p["trained"] for p in points):
        print("nothing trained", file=sys.stderr)
        return 1
    sweep_report(args, points)
    return 0


# ---- report: what the memory buys, one file per GPU and date -----------------------------------


def sweep_series(points: list[dict]) -> tuple[str, dict]:
    """(the swept axis: "seq", "mbs" or "tokens", {impl: [point, ...] in order of that axis})."""
    axis = "seq" if len({p["mbs"] for p in points}) == 1 else "mbs" if len({p["seq"] for p in points}) == 1 else "tokens"
    series = {}
    for p in points:
        series.setdefault(p["impl"], []).append({**p, "tokens": p["seq"] * p["mbs"]})
    return axis, {impl: sorted(ps, key=lambda q: q[axis]) for impl, ps in series.items()}


def sweep_file(path: Path) -> list[tuple[dict, list[dict]]]:
    """[(recipe/gpu/world, points), ...] of a sweep's points.json (a list of points, no recipe), an
    older sweep report ({"points": [...]}) or a sweep's or report's JSON ({"sweeps": [...]})."""
    raw = json.loads(path.read_text())
    if isinstance(raw, list):
        return [({}, raw)]

    def info(d: dict) -> dict:
        return {k: d.get(k) for k in ("recipe", "gpu", "world")}

    if "points" in raw:
        return [(info(raw), raw["points"])]
    return [(info(sw), [q for ps in sw["series"].values() for q in ps]) for sw in raw["sweeps"]]


def report_data(sweeps: list[Path], runs: list[Path], warmup: int) -> dict:
    """The sweeps' points (files of one recipe and axis merged: one sweep cut over several launches)
    by loss.impl, and each run's summary and loss curves."""
    data, merged = {"sweeps": [], "runs": []}, {}
    for path in sweeps:
        for info, points in sweep_file(path):
            points = [{k: v for k, v in p.items() if k not in ("meta", "tokens")} for p in points]
            entry = merged.setdefault((info.get("recipe"), sweep_series(points)[0]), {**info, "files": [], "points": []})
            entry["files"].append(str(path))
            entry["points"] += points
    for entry in merged.values():
        axis, series = sweep_series(entry.pop("points"))
        largest = {impl: max((q[axis] for q in ps if q["trained"]), default=None) for impl, ps in series.items()}
        data["sweeps"].append({**entry, "axis": axis, "series": series, "largest": largest})
    data["runs"] = [summarize(run_dir, warmup) for run_dir in runs]
    if len({r["label"] for r in data["runs"]}) < len(runs):  # runs of one loss.impl: told apart by their names
        for r in data["runs"]:
            r["label"] += f" ({r['run_name']})"
    data["comparisons"] = [compare_losses(data["runs"][0], r) for r in data["runs"][1:]]
    meta = next((r for r in data["runs"]), None) or next((s for s in data["sweeps"] if s.get("gpu")), {})
    data["gpu"] = meta.get("device_name") or meta.get("gpu")
    return data


def report_md(data: dict) -> str:
    lines = [f"# What the loss layer's memory buys: {data['gpu']}", ""]
    if "meta" in data:
        lines += [f"{data['meta']['date']} · commit `{data['meta']['git_commit']}` · `{data['meta']['command']}`", ""]
    for sw in data["sweeps"]:
        impls = list(sw["series"])
        lines += [f"## {sw.get('recipe') or 'sweep'}: against {sw['axis']} ({', '.join(sw['files'])})", ""]
        xs = sorted({q[sw["axis"]] for ps in sw["series"].values() for q in ps})
        cell = {(impl, q[sw["axis"]]): (f"{q['tokens_per_s']:,.0f} · {q['peak_mem_max'] / 2**30:.1f}"
                                         + (f" (then exit {q['exit']})" if q.get("exit", 0) != 0 else "")
                                         if q["trained"] else q.get("why", "no")) for impl, ps in sw["series"].items() for q in ps}
        lines += C.md_table([sw["axis"], *(f"{i}: tokens/s · peak GiB per rank" for i in impls)],
                            [[f"{x:,}", *(cell.get((i, x), "") for i in impls)] for x in xs])
        ref = sw["largest"].get(impls[0])
        lines += ["", "Largest that trains: " + "; ".join(
            f"{i} {C.fmt_num(v, ',')}" + (f" ({ref / v:.2f}x of it for {impls[0]})" if ref and v and i != impls[0] else "")
            for i, v in sw["largest"].items()) + ".", ""]
    if data["runs"]:
        ref = next((r for r in data["runs"] if r["label"] == "megatron"), data["runs"][0])
        lines += [f"## Training side by side: {ref['steps']} steps, {ref['tokens_per_step']:,} tokens per step", ""]
        lines += C.md_table(["loss layer", "tokens/s", f"over {ref['label']}'s", "peak GiB per rank", "final val loss",
                             f"over {ref['label']}'s"],
                            [[r["label"], f"{r['tokens_per_s_median']:,.0f}",
                              f"{r['tokens_per_s_median'] / ref['tokens_per_s_median']:.3f}",
                              C.fmt_num(r["peak_mem_max"] and r["peak_mem_max"] / 2**30, ".1f"),
                              C.fmt_num(r["final_val_loss"], ".4f"),
                              C.fmt_num(r["final_val_loss"] and r["final_val_loss"] / ref["final_val_loss"], ".4f")]
                             for r in data["runs"]])
        for c in data.get("comparisons", []):
            val = ", ".join(f"step {s}: {d:+.4f}" for s, d in c["val_loss_diff"].items()) or "–"
            lines += ["", (f"{c['a']} − {c['b']}: first-step loss difference {C.fmt_num(c['first_step_diff'], '.2e')}, "
                           f"max |difference| over {c['steps_compared']} steps {C.fmt_num(c['max_abs_diff'], '.3f')}, "
                           f"mean over the last 50 steps {C.fmt_num(c['mean_diff_last50'], '.4f')}; validation loss "
                           f"differences {val}.")]
        lines += ["", *(f"- {r['label']}: `{r['command']}`" for r in data["runs"])]
    return "\n".join(lines) + "\n"


def report_png(data: dict, path: Path) -> bool:
    """Tokens/s and peak memory against each sweep's axis, and the loss curves; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = len(data["sweeps"]) + bool(data["runs"])  # a row per sweep (tokens/s, memory), then the loss curves
    fig = plt.figure(figsize=(10, 3.4 * rows))
    grid = fig.add_gridspec(rows, 2)
    for row, sw in enumerate(data["sweeps"]):
        for col, key, label in ((0, "tokens_per_s", "tokens/s"), (1, "peak_mem_max", "peak GiB per rank")):
            ax = fig.add_subplot(grid[row, col])
            for impl, ps in sw["series"].items():
                done = [q for q in ps if q["trained"]]
                ax.plot([q[sw["axis"]] for q in done], [q[key] / (2**30 if key == "peak_mem_max" else 1) for q in done],
                        marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set(xlabel=sw["axis"], ylabel=label, title=f"{Path(sw.get('recipe') or 'sweep').stem}: against {sw['axis']}")
            ax.legend(fontsize=7)
    if data["runs"]:
        ax = fig.add_subplot(grid[rows - 1, :])
        for r in data["runs"]:
            ax.plot(*zip(*r["train_curve"]), lw=0.8, label=f"{r['label']} (train)")
            if r["val_curve"]:
                ax.plot(*zip(*r["val_curve"]), marker="o", ls="--", label=f"{r['label']} (val)")
        ax.set(xlabel="step", ylabel="loss", title="loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description="one report of sweeps and a compare")
    p.add_argument("--sweeps", nargs="*", default=[], type=Path, help="sweep results: points.json, train_sweep_*.json or a report's JSON")
    p.add_argument("--runs", nargs="*", default=[], type=Path, help="run directories of one setting, one per loss.impl")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--name", required=True, help="the report's file name, without suffix")
    args = p.parse_args(argv)
    write(args.out / args.name, report_data(args.sweeps, args.runs, args.warmup))
    return 0


COMMANDS = {"compare": compare, "sweep": sweep, "report": report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
