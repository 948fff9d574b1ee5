"""Tokens/s with and without apex from this directory's logs: python summarize.py > summary.md

The median of each run's steps from 3 on (steps 1-2 compile and warm up), and its peak memory."""

import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent / "logs"
RUNS = [  # (log, recipe, apex)
    ("gN1", "gemma-2b-owt", "none"), ("gA1", "gemma-2b-owt", "amp_C + fused_weight_gradient_mlp_cuda"),
    ("gN2", "gemma-2b-owt", "none"), ("gA2", "gemma-2b-owt", "amp_C + fused_weight_gradient_mlp_cuda"),
    ("lN1", "llama-1b-owt (tp 1)", "none"), ("lA1", "llama-1b-owt (tp 1)", "amp_C + fused_weight_gradient_mlp_cuda"),
]
STEP = re.compile(r"^step +(\d+)/\d+ .*\| ([\d,]+) tok/s .*peak mem ([\d.]+) GiB")


def run(name):
    steps = [(int(m[1]), int(m[2].replace(",", "")), float(m[3]))
             for m in map(STEP.match, (HERE / f"{name}.log").read_text().splitlines()) if m]
    later = [tps for step, tps, _ in steps if step >= 3]
    return statistics.median(later), len(later), max(peak for *_, peak in steps)


print("| run | recipe | apex | tokens/s (median, steps 3+) | steps | peak GiB |")
print("|---|---|---|---|---|---|")
medians = {}
for name, recipe, apex in RUNS:
    median, n, peak = run(name)
    medians[name] = median
    print(f"| {name} | {recipe} | {apex} | {median:,.0f} | {n} | {peak:.2f} |")
print()
for label, with_, without in (("gemma-2b-owt, run 1", "gA1", "gN1"), ("gemma-2b-owt, run 2", "gA2", "gN2"),
                              ("llama-1b-owt", "lA1", "lN1")):
    print(f"- {label}: apex / none = {medians[with_] / medians[without]:.3f}")
