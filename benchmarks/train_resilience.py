"""What do background checkpoints, a preemption signal and deterministic mode cost a real run?

The Gemma 2 2B recipe (tp1 x dp NPROC), one torchrun launch per run, offline data; phases
``throughput`` (plain, saving, signal + restart), ``determinism`` (det-a, det-b, det-sig),
``cost`` (det-c on plain's machine) and ``report``; each adds its runs to OUT/runs.json and the
report goes to ``OUT/train_resilience_<gpu>x<n>_<yyyymmdd>.{json,md}`` (docs/training.md).

    python benchmarks/train_resilience.py --phase throughput --out OUT
    # CPU smoke: --recipe recipes/tiny.yaml --nproc 2 --steps 6 --save-every 2 --signal-at 3
    #   --extra data.vocab_size=1024 model.vocab_size=null train.global_batch_size=8
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))

import _common as C

from cce_parallel.train.metrics import read_metrics


def common(args) -> list[str]:
    work = Path(args.work)
    return [f"run.out_dir={work / 'runs'}", "run.seed=1234", "data.source=stdlib", "data.tokenizer=bpe",
            "data.vocab_size=8192", f"data.dir={work / 'data'}", "model.vocab_size=256000", f"train.steps={args.steps}",
            "train.micro_batch_size=4", f"train.global_batch_size={16 * args.nproc}", "optim.warmup_steps=5",
            "eval.interval=0", "eval.iters=1", "logging.interval=5", "logging.wandb=disabled", "checkpoint.keep=2",
            *args.extra]


def launch(args, name: str, extra: list[str], *, signal_at: int | None = None) -> dict:
    """One torchrun launch of the recipe; with signal_at, SIGTERM to torchrun once that step is
    logged. Returns {exit, seconds, signalled_at}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "cce_parallel.train", "--recipe", args.recipe,
           "--set", *common(args), f"run.name={name}", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}
    print(f"=== {name}: {' '.join(extra)} ({time.strftime('%H:%M:%S')})", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    signalled = None
    metrics = Path(args.work) / "runs" / name / "metrics.jsonl"
    try:
        while proc.poll() is None:
            if time.monotonic() - start > args.launch_timeout:
                proc.send_signal(signal.SIGKILL)
                break
            if signal_at is not None and signalled is None and metrics.exists():
                steps = read_metrics(metrics)["train"]
                if max(steps, default=0) >= signal_at:
                    signalled = max(steps)
                    print(f"=== {name}: SIGTERM to torchrun after step {signalled}", flush=True)
                    proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"exit": proc.returncode, "seconds": time.monotonic() - start, "signalled_at": signalled}


def collect(args, name: str, launches: list[dict]) -> dict:
    path = Path(args.work) / "runs" / name / "metrics.jsonl"
    m = read_metrics(path)
    return {"name": name, "work": str(path.parent), "launches": launches, "meta": m["meta"][-1] if m["meta"] else None,
            "train": m["train"], "checkpoint": m["checkpoint"], "checkpoint_start": m["checkpoint_start"],
            "resume": m["resume"]}


def save_runs(out: Path, runs: list[dict], *, done: bool = True):
    """Adds the runs to OUT/runs.json; once a run is done, deletes its checkpoints (37 GB each for
    the Gemma recipe: the runs' checkpoints together would fill the disk)."""
    for r in runs if done else ():
        shutil.rmtree(Path(r["work"]) / "checkpoints", ignore_errors=True)
    path = out / "runs.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    known.update({r["name"]: r for r in runs})
    path.write_text(json.dumps(known, indent=1))


def phase_throughput(args, out: Path):
    """plain, then saving, then signal (SIGTERM after --signal-at steps: the save on a signal, on
    every GPU) and its restart to the end (the checks' and the load's times). The signal run saves
    less often than saving: torch 2.11's torchrun SIGKILLs its workers 30 s after forwarding a
    signal, so the save on the signal must not wait for a background write still in flight."""
    save_runs(out, [collect(args, "plain", [launch(args, "plain", ["checkpoint.interval=0", "checkpoint.at_end=false"])])])
    save_runs(out, [collect(args, "saving", [launch(args, "saving", [f"checkpoint.interval={args.save_every}"])])])
    every = [f"checkpoint.interval={args.signal_save_every}"]
    first = launch(args, "signal", every, signal_at=args.signal_at)
    save_runs(out, [collect(args, "signal", [first])], done=False)
    save_runs(out, [collect(args, "signal", [first, launch(args, "signal", every)])])


DETERMINISTIC = ["train.deterministic=true", "checkpoint.interval=0", "checkpoint.at_end=false"]  # a signal still saves


def phase_cost(args, out: Path):
    """det-c: det-a's command again, for its tokens/s against plain where the two ran on one machine."""
    save_runs(out, [collect(args, "det-c", [launch(args, "det-c", DETERMINISTIC)])])


def phase_determinism(args, out: Path):
    det = DETERMINISTIC
    for name in ("det-a", "det-b"):
        save_runs(out, [collect(args, name, [launch(args, name, det)])])
    first = launch(args, "det-sig", det, signal_at=args.signal_at)
    save_runs(out, [collect(args, "det-sig", [first])], done=False)
    save_runs(out, [collect(args, "det-sig", [first, launch(args, "det-sig", det)])])


def tokens_per_s(run: dict, first: int = 1, last: int | None = None) -> float:
    """Tokens of the steps after `first` up to `last` over the wall-clock time from the end of
    step `first` to the end of step `last`: saves, and waits for them, included."""
    steps = [s for s in sorted(run["train"], key=int) if int(s) >= first and (last is None or int(s) <= last)]
    recipe = run["meta"]["recipe"]
    tokens = (len(steps) - 1) * recipe["train"]["global_batch_size"] * recipe["model"]["seq_length"]
    return tokens / (run["train"][steps[-1]]["time"] - run["train"][steps[0]]["time"])


def report(out: Path, recipe: str, note: str = "") -> int:
    runs = json.loads((out / "runs.json").read_text())
    meta = next(r["meta"] for r in runs.values() if r["meta"])
    gpu = meta["device_name"]
    world = meta["layout"]["world"]
    day = _dt.datetime.fromtimestamp(meta["time"], tz=_dt.timezone.utc).date()  # of the runs, not of rendering
    date = day.strftime("%Y%m%d")
    lines = [f"# Checkpoints, signals and deterministic mode: {recipe}, {world}x {gpu}", "",
             f"- commit {meta.get('commit')}, torch {meta['torch']}, megatron-core {meta['megatron_core']}, "
             f"{day.isoformat()}" + (f"; {note}" if note else ""),
             (f"- tp {meta['layout']['tp']} x dp {meta['layout']['dp']}, distributed optimizer "
             f"{meta['recipe']['parallel']['distributed_optimizer']}, micro-batch "
             f"{meta['recipe']['train']['micro_batch_size']}, {meta['layout']['accumulation']} micro-batches per step, "
             f"seq {meta['recipe']['model']['seq_length']}; {meta['params_total'] / 1e6:.0f}M parameters"),
             ("- command: `python benchmarks/train_resilience.py --phase throughput|determinism` "
             "(tokens/s: wall clock from the end of step 1 to the end of the last, saves included)"), ""]
    summary = {"gpu": gpu, "world": world, "recipe": recipe, "commit": meta.get("commit"), "note": note, "date": date,
               "runs": {}}
    if "plain" in runs and "saving" in runs:
        plain, saving = tokens_per_s(runs["plain"]), tokens_per_s(runs["saving"])
        summary["throughput"] = {"plain_tokens_per_s": plain, "saving_tokens_per_s": saving, "ratio": saving / plain}
        rows = [["no checkpoint", f"{plain:,.0f}", "1.000"],
                [f"a checkpoint every {_interval(runs['saving'])} steps", f"{saving:,.0f}", f"{saving / plain:.3f}"]]
        lines += ["## Background checkpoints", "", "Tokens/s from the end of step 1 to the end of the last, wall clock:",
                  "", *C.md_table(["run", "tokens/s", "ratio"], rows), ""]
        lines += _checkpoint_table(runs["saving"])
    if "signal" in runs:
        run = runs["signal"]
        sig, restart = run["launches"][0], run["launches"][-1]
        last = sig["signalled_at"]
        saved = [int(k) for k in run["checkpoint"] if last is not None and int(k) > last]
        signal_saved = bool(saved) and min(saved) == last + 1 and bool(run["resume"].get(str(last + 1)))
        summary["signal"] = {"signalled_at": last, "saved_step": last + 1 if signal_saved else None,
                             "exits": [x["exit"] for x in run["launches"]], "resumed_at": list(run["resume"])}
        lines += ["## A signal", "",
                  (f"A checkpoint every {_interval(run)} steps; SIGTERM to torchrun after step {last}: checkpoint of "
                  f"step {last + 1} {'written' if signal_saved else 'NOT written'}; torchrun's exit status "
                  f"{sig['exit']} (it exits 1 after forwarding a signal); the restart resumed from step(s) "
                  f"{list(run['resume'])} and exited {restart['exit']}."), ""]
        lines += _checkpoint_table(run)
        for k, r in run["resume"].items():
            lines += [(f"Resume from step {k}: checksums checked in {r['verify_s']:.1f} s, state loaded in "
                      f"{r['load_s']:.1f} s."), ""]
    # det-c: a later launch of det-a's command on the machine that ran plain (phase "cost").
    det = [n for n in ("det-a", "det-b", "det-sig", "det-c") if n in runs]
    if det:
        ref = det[0]  # det-a, unless only phase cost ran
        steps = sorted(runs[ref]["train"], key=int)
        same = {n: all(runs[n]["train"].get(s, {}).get(k) == runs[ref]["train"][s][k]
                       for s in steps for k in ("loss", "grad_norm")) for n in det}
        sig = runs.get("det-sig", {})
        resumed_at = list(sig.get("resume", {}))
        summary["determinism"] = {"steps": len(steps), "reference": ref, "bitwise_equal": same,
                                  "signalled_at": [x["signalled_at"] for x in sig.get("launches", [])],
                                  "exits": [x["exit"] for x in sig.get("launches", [])], "resumed_at": resumed_at}
        lines += ["## Deterministic mode (train.deterministic: true)", "",
                  f"Per-step loss and gradient norm over {len(steps)} steps, compared bit for bit with {ref}:", "",
                  *C.md_table(["run", f"bitwise equal to {ref}"], [[n, "yes" if same[n] else "NO"] for n in det])]
        if sig:
            lines += ["", (f"det-sig: SIGTERM to torchrun after step {summary['determinism']['signalled_at'][0]}; "
                          f"launch exit statuses {summary['determinism']['exits']}; resumed at step(s) {resumed_at}.")]
        if "plain" in runs:
            d, p = tokens_per_s(runs[det[-1]] if det[-1] == "det-c" else runs[ref]), tokens_per_s(runs["plain"])
            summary["determinism"].update(tokens_per_s=d, plain_tokens_per_s=p, ratio=d / p)
            lines += ["", f"Throughput: {d:,.0f} tokens/s against {p:,.0f} without deterministic mode ({d / p:.3f}x)."]
        lines.append("")
    for name, r in runs.items():
        ts = [r["train"][s]["grad_norm"] for s in sorted(r["train"], key=int)[:3]]
        # One launch: a wall-clock span; a restart's records follow a gap.
        summary["runs"][name] = {"launches": r["launches"],
                                 "tokens_per_s": tokens_per_s(r) if len(r["launches"]) == 1 else None, "first_grad_norms": ts}
    stem = out / f"train_resilience_{C.gpu_slug(gpu)}x{world}_{date}"
    C.write_report(stem, summary, "\n".join(lines))
    print("\n".join(lines))
    return 0


def _checkpoint_table(run: dict) -> list[str]:
    rows = []
    done, begun = run["checkpoint"], run["checkpoint_start"]
    for k in sorted(set(done) | set(begun), key=int):
        started, c = begun.get(k, {}), done.get(k)
        if c is None:
            rows.append([k, "", f"{started['blocked_s']:.2f} ({started['waited_s']:.2f})", "not completed", "", "", "", ""])
            continue
        rows.append([k, f"{c['bytes'] / 1e9:.1f}",
                     f"{started.get('blocked_s', c['blocked_s']):.2f} ({started.get('waited_s', 0.0):.2f})",
                     f"{c['stage_s']:.2f}", f"{c['total_s'] - c['blocked_s']:.1f}", f"{c['write_gb_per_s']:.2f}",
                     f"{c['publish_s']:.2f}", f"{c.get('prune_s', 0.0):.2f}"])
    header = ["step", "GB", "training blocked s (waiting for the previous save)", "staging s", "background write s",
              "GB/s (write)", "meta.json + rename s", "pruning s"]
    return [*C.md_table(header, rows), ""]


def _interval(run: dict) -> int:
    return run["meta"]["recipe"]["checkpoint"]["interval"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("throughput", "determinism", "cost", "report"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/cce_resilience")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--signal-at", type=int, default=15)
    p.add_argument("--signal-save-every", type=int, default=20)
    p.add_argument("--launch-timeout", type=float, default=300)
    p.add_argument("--recipe", default="recipes/gemma-2b-owt.yaml")
    p.add_argument("--extra", nargs="*", default=[], help="more --set overrides, applied after the script's")
    p.add_argument("--note", default="", help="a line for the report's header (e.g. what the code was)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "report":
        return report(out, args.recipe, args.note)
    # Prepared once (tokenizer training and tokenization), before any torchrun launch.
    prep = [sys.executable, "-m", "cce_parallel.train", "--recipe", args.recipe, "--prepare-data",
            "--set", *common(args)]
    subprocess.run(prep, cwd=ROOT, check=True)
    {"throughput": phase_throughput, "determinism": phase_determinism, "cost": phase_cost}[args.phase](args, out)
    return report(out, args.recipe, args.note)


if __name__ == "__main__":
    sys.exit(main())
