"""The harness every benchmark shares: shapes, inputs, timing, memory, references, metadata, output.
No cce_parallel, no peer and no CUDA query at import, so ``--help`` works without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import gc
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
SMOKE_OUT = Path("/tmp/cce_parallel_bench_smoke")
MiB = float(1 << 20)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FatalCudaError(RuntimeError):
    """The CUDA context is broken (illegal access, device assert): nothing more can run."""


@dataclass(frozen=True)
class Shape:  # one classifier head: N tokens, vocabulary V, hidden size D
    name: str
    N: int
    V: int
    D: int


# (V, D) of the output heads of real models; tiny odd ones for the CPU smoke mode.
MODEL_SHAPES: dict[str, tuple[int, int]] = {"gemma2-2b": (256000, 2304), "gemma2-9b": (256000, 3584),
                                            "llama3-8b": (128256, 4096), "mistral-nemo": (131072, 5120),
                                            "qwen2.5-7b": (152064, 3584), "phi3.5-mini": (32064, 3072)}
SMOKE_SHAPES: dict[str, tuple[int, int]] = {"tiny-a": (517, 48), "tiny-b": (1000, 32)}


def parse_shape(item: str, tokens: int, table: dict[str, tuple[int, int]]) -> Shape:
    """A name from ``table`` (with ``tokens`` tokens) or a custom ``NxVxD``."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", item)
    if m:
        return Shape(item, *map(int, m.groups()))
    if item not in table:
        raise SystemExit(f"unknown shape {item!r}; known: {', '.join(table)} or NxVxD")
    return Shape(item, tokens, *table[item])


def csv_list(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def arg_parser(doc: str, *, regimes: str, methods: str, methods_help: str, warmup: int) -> argparse.ArgumentParser:
    """The options bench_loss and bench_tp share; each adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--regimes", default=regimes, help=f"comma list from {', '.join(REGIMES)}")
    p.add_argument("--methods", default=methods, help=methods_help)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed calls before timing (after the accuracy call)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls; the median is reported")
    p.add_argument("--rounds", type=int, default=5, help="fwd+bwd rounds over all methods (--repeats in all)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
    p.add_argument("--tag", default=None, help="suffix of the output names: <gpu>_<yyyymmdd>[_tp]_<tag>")
    p.add_argument("--commit", default=None, help="commit to record (where the tree has no .git)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (gloo for tp): tests the plumbing")
    return p


def parse_run_args(p: argparse.ArgumentParser, argv, smoke: dict) -> argparse.Namespace:
    """Parse; with --cpu-smoke, every option of `smoke` left at its default takes its smoke value.
    --regimes becomes a list of known regimes."""
    args = p.parse_args(argv)
    if args.cpu_smoke:
        for name, value in smoke.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.rounds = max(1, min(args.rounds, args.repeats))
    args.regimes = csv_list(args.regimes)
    for r in args.regimes:
        if r not in REGIMES:
            raise SystemExit(f"unknown regime {r!r}; known: {', '.join(REGIMES)}")
    return args


# ---- Inputs (the regimes are described in docs/performance.md and benchmarks/README.md) ----------

C_INIT_STD = 0.02  # GPT-style init of the classifier
SOFTMAX_EPS = 2.0**-12  # CCE's bf16 gradient-filter epsilon, whose mass we report
ZIPF_S, TRAINED_CANDIDATES, TRAINED_RANK_S, TRAINED_BACKGROUND = 1.1, 50, 1.0, 0.05
CONFIDENT_SHARE, CONFIDENT_P = 0.5, 0.99

REGIMES = {
    "random": (
        "untrained-model-like: e ~ N(0, 1) per element (post-RMSNorm hidden states), "
        f"c ~ N(0, {C_INIT_STD}^2) (GPT-style init), targets uniform on [0, V); "
        "logits have std ≈ 0.02·sqrt(D) ≈ 1, so the softmax is nearly flat"
    ),
    "trained": (
        f"trained-model-like: c ~ N(0, {C_INIT_STD}^2); per row, {TRAINED_CANDIDATES} distinct plausible "
        f"tokens drawn Zipf(s={ZIPF_S}) by frequency rank (BPE-like: frequent tokens have small ids) hold "
        f"{1 - TRAINED_BACKGROUND:.0%} of the mass as p_k ∝ k^-{TRAINED_RANK_S} (k a random rank), the "
        "other tokens share the rest with N(0, 1) logit noise; e solves for those logits exactly (least "
        "squares over the plausible rows, plus a random part orthogonal to them); the target is drawn "
        "from the plausible tokens by their probability. So ~50 entries per row reach 2^-12 and the "
        "loss is ~3 nats, as the CCE paper measured on real models"
    ),
    "confident": (
        f"trained, except that on {CONFIDENT_SHARE:.0%} of the rows (evenly spread) the model is sure of the "
        f"target: e moves along the target's row of c until p(target) = {CONFIDENT_P} (as a trained language "
        "model is for many tokens); it checks the accuracy of a logit gradient p - 1 that is small beside p"
    ),
}


def _zipf_ids(shape, V: int, gen: torch.Generator, device) -> torch.Tensor:
    probs = torch.arange(1, V + 1, device=device, dtype=torch.float64).pow(-ZIPF_S)
    probs = (probs / probs.sum()).float()
    return torch.multinomial(probs, math.prod(shape), replacement=True, generator=gen).view(shape)


def _distinct_zipf_ids(N: int, K: int, V: int, gen: torch.Generator, device) -> torch.Tensor:
    """[N, K] ids, distinct within each row, Zipf-frequent (rows short of K distinct draws are
    completed with uniform ids, which are distinct from the rest with high probability)."""
    srt, _ = _zipf_ids((N, 4 * K), V, gen, device).sort(dim=1)
    dup = torch.zeros_like(srt, dtype=torch.bool)
    dup[:, 1:] = srt[:, 1:] == srt[:, :-1]
    filler = torch.randint(0, V, srt.shape, device=device, generator=gen)
    # Distinct ids first (in a random order), duplicates replaced by uniform ids after them.
    key = torch.rand(srt.shape, device=device, generator=gen) + dup.float()
    return torch.where(dup, filler, srt).gather(1, key.argsort(dim=1))[:, :K]


def make_inputs(shape: Shape, regime: str, *, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """(e [N, D], c [V, D], targets [N] int64) of one regime, deterministic in ``seed``; leaves
    in ``dtype`` without requires_grad."""
    N, V, D = shape.N, shape.V, shape.D
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    c = (torch.randn(V, D, device=device, generator=gen) * C_INIT_STD).to(dtype)
    if regime == "random":
        e = torch.randn(N, D, device=device, generator=gen).to(dtype)
        return e, c, torch.randint(0, V, (N,), device=device, generator=gen)
    if regime not in ("trained", "confident"):
        raise ValueError(f"unknown regime {regime!r}; known: {', '.join(REGIMES)}")
    K = min(TRAINED_CANDIDATES, V, D)
    ids = _distinct_zipf_ids(N, K, V, gen, device)
    rank = torch.rand(N, K, device=device, generator=gen).argsort(dim=1).double() + 1.0
    p = rank.pow(-TRAINED_RANK_S)
    p = (1.0 - TRAINED_BACKGROUND) * p / p.sum(dim=1, keepdim=True)
    # Background logits ~N(0, 1): their exp sums to about V e^(1/2), which is TRAINED_BACKGROUND of Z.
    log_z = math.log(V * math.exp(0.5) / TRAINED_BACKGROUND)
    logit = (p.log() + log_z).float()  # [N, K]
    t = ids.gather(1, torch.multinomial(p.float(), 1, generator=gen)).squeeze(1)
    e = torch.empty(N, D, device=device, dtype=dtype)
    step = 2048
    for s in range(0, N, step):
        rows = c[ids[s : s + step]].float()  # [n, K, D], the rounded c the methods see
        # e = R^T (R R^T)^-1 L + w_perp: exact logits on the plausible rows, noise elsewhere.
        gram = rows @ rows.transpose(1, 2)
        coef = torch.linalg.solve(gram, logit[s : s + step].unsqueeze(2))
        sig = (rows.transpose(1, 2) @ coef).squeeze(2)
        w = torch.randn(sig.shape, device=device, generator=gen) / (C_INIT_STD * math.sqrt(D))
        proj = torch.linalg.solve(gram, (rows @ w.unsqueeze(2)))
        w = w - (rows.transpose(1, 2) @ proj).squeeze(2)
        e[s : s + step] = (sig + w).to(dtype)
    if regime == "confident":
        _make_confident(e, c, t, step)
    return e, c, t


def _make_confident(e: torch.Tensor, c: torch.Tensor, t: torch.Tensor, step: int) -> None:
    """In place: on every 1 / CONFIDENT_SHARE-th row, move e along c[target] until the target's
    logit is log(CONFIDENT_P / (1 - CONFIDENT_P)) above the log-sum-exp of the others."""
    rows = torch.arange(0, e.shape[0], max(1, round(1 / CONFIDENT_SHARE)), device=e.device)
    for s in range(0, rows.numel(), step):
        r = rows[s : s + step]
        z = e[r].float() @ c.float().T
        tr = t[r][:, None]
        zt = z.gather(1, tr).squeeze(1)
        rest = torch.logsumexp(z.scatter_(1, tr, float("-inf")), dim=1)
        ct = c[t[r]].float()
        alpha = rest + math.log(CONFIDENT_P / (1 - CONFIDENT_P)) - zt
        e[r] = (e[r].float() + alpha[:, None] * ct / (ct * ct).sum(1, keepdim=True)).to(e.dtype)
        del z


@torch.no_grad()
def softmax_stats(e, c, t, *, rows: int = 1024, eps: float = SOFTMAX_EPS) -> dict:
    """Softmax statistics in fp32 on an evenly spaced subsample of rows (the inputs upcast)."""
    N, V = e.shape[0], c.shape[0]
    idx = torch.linspace(0, N - 1, steps=min(rows, N), device=e.device).round().long().unique()
    c32 = c.float()
    count = 0
    p_t = []
    chunk = max(1, min(256, (1 << 28) // max(V, 1)))
    for s in range(0, idx.numel(), chunk):
        r = idx[s : s + chunk]
        x = e[r].float() @ c32.T
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        p = torch.exp(x - lse)
        count += int((p >= eps).sum())
        p_t.append(p.gather(1, t[r][:, None]).squeeze(1))
        del x, p, lse
    del c32
    n = idx.numel()
    return {"rows_sampled": n, "eps": eps, "frac_ge_eps": count / (n * V), "entries_ge_eps_per_row": count / n,
            "p_target_median": float(torch.cat(p_t).double().median())}


@torch.no_grad()
def reference_loss_grads(e, c, t, *, coef: torch.Tensor | None = None, chunk_bytes: int = 1 << 30):
    """Mean cross-entropy and its fp32 ∇E [N, D], ∇C [V, D] from the inputs upcast, chunked over
    tokens ([chunk, V] fp32 logits alive), TF32 off. With coef (shaped like t), the loss
    Σ coef_i · loss_i instead (a weighted or masked loss) and its gradients."""
    N, V = e.shape[0], c.shape[0]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        c32 = c.float()
        a = coef.reshape(-1).float() if coef is not None else None
        g_e = torch.empty(e.shape, dtype=torch.float32, device=e.device)
        g_c = torch.zeros(c.shape, dtype=torch.float32, device=e.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=e.device)
        chunk = max(1, min(N, chunk_bytes // (4 * V)))
        for s in range(0, N, chunk):
            e32 = e[s : s + chunk].float()
            tt = t[s : s + chunk]
            x = e32 @ c32.T
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            per_token = (lse.squeeze(1) - x.gather(1, tt[:, None]).squeeze(1)).double()
            loss_sum += per_token.sum() if a is None else (per_token * a[s : s + chunk].double()).sum()
            x.sub_(lse).exp_()  # x is now the softmax
            x[torch.arange(tt.numel(), device=e.device), tt] -= 1.0
            x.mul_(1.0 / N if a is None else a[s : s + chunk, None])
            torch.mm(x, c32, out=g_e[s : s + chunk])
            g_c.addmm_(x.T, e32)
            del x, e32, lse
        del c32
        return float(loss_sum) / (N if a is None else 1), g_e, g_c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@torch.no_grad()
def rel_err(x: torch.Tensor, ref: torch.Tensor, *, rows: int = 8192) -> float:
    """‖x − ref‖_F / ‖ref‖_F, in fp32 (fp64 accumulation), chunked over rows."""
    num = den = 0.0
    for s in range(0, ref.shape[0], rows):
        r = ref[s : s + rows]
        num += float((x[s : s + rows].float() - r).double().pow(2).sum())
        den += float(r.double().pow(2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else float("nan")


# ---- Timing and memory ---------------------------------------------------------------------------


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], *, device, warmup=3, repeats=10, setup: Callable | None = None) -> list:
    """Per-repeat times of ``fn()`` in ms: CUDA events (read after the last call), else perf_counter.
    ``setup()`` runs before each call, outside the timed region."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    sync(device)
    cuda, times, events = is_cuda(device), [], []
    for _ in range(repeats):
        if setup is not None:
            setup()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) for a, b in events]
    return times


def balanced_orders(n: int, rounds: int) -> list:
    """Orders of n keys for `rounds` rounds: the rows of a Williams design in turn (first row 0, 1,
    n-1, 2, n-2, ..., the others add 1, 2, ... mod n; for an odd n the reversed rows follow), so
    that over n (odd n: 2n) rows every key runs in every position, and right after every other
    key, equally often."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(k + i) % n for k in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [rows[r % len(rows)] for r in range(rounds)]


def round_sizes(repeats: int, rounds: int) -> list:
    """Timed calls per key in each round of time_in_rounds (its times come in this order)."""
    return [repeats // rounds + (i < repeats % rounds) for i in range(rounds)]


def time_in_rounds(calls: list, *, device, warmup: int, repeats: int, rounds: int, setup=None) -> dict:
    """Time the (key, fn) `calls` side by side in `rounds` rounds, each running every key in turn
    (`warmup` untimed calls in the first round, one in later ones), `repeats` timed calls per key
    in all, the rounds' orders from balanced_orders: a drifting clock, or what ran just before,
    then weighs on every key alike. Returns {key: (times in ms, the exception that stopped it or
    None)}; a failed key is not run again, a fatal CUDA error stops everything."""
    out = {key: ([], None) for key, _ in calls}
    for i, (n, rows) in enumerate(zip(round_sizes(repeats, rounds), balanced_orders(len(calls), rounds))):
        for key, fn in [calls[j] for j in rows]:
            times, failed = out[key]
            if failed is not None:
                continue
            try:
                times += time_ms(fn, device=device, warmup=warmup if i == 0 else 1, repeats=n, setup=setup)
            except Exception as exc:  # noqa: BLE001 - the caller records it
                out[key] = (times, exc)
                if is_fatal_cuda_error(exc):
                    return out
            finally:
                if setup is not None:
                    setup()
    return out


def paired_ratio(times: list, ref_times: list, sizes: list):
    """The median over rounds of (median of `times` in the round / median of `ref_times` in it),
    both laid out in rounds of `sizes` calls; None unless both have every call."""
    if len(times) != sum(sizes) or len(ref_times) != sum(sizes) or not sizes:
        return None
    ratios, start = [], 0
    for n in sizes:
        if n:
            ratios.append(statistics.median(times[start:start + n]) / statistics.median(ref_times[start:start + n]))
        start += n
    return statistics.median(ratios) if ratios else None


def summarize_times(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": len(times),
            "times_ms": [round(t, 4) for t in times]}  # in the order taken (rounds, for time_in_rounds)


def peak_bytes(fn: Callable[[], object], *, device) -> int | None:
    """Peak allocated bytes above what was allocated before ``fn()`` (None off CUDA); what ``fn``
    returns stays alive until the peak is read."""
    if not is_cuda(device):
        fn()
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    keep = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del keep
    return int(peak)


def free_memory(device=None) -> None:
    """Collect garbage and return cached blocks; never raises (the context may be broken)."""
    gc.collect()
    with contextlib.suppress(Exception):  # best effort; the caller reports the real error
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """Errors after which the CUDA context is unusable, so the run must stop."""
    return any(k in str(exc).lower() for k in ("illegal memory access", "device-side assert", "misaligned address",
                                               "unspecified launch failure", "illegal instruction",
                                               "uncorrectable ecc", "cuda error: an illegal"))


def short_error(exc: BaseException, limit: int = 300) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def failure(exc: BaseException, stage: str) -> dict:
    return {"status": "oom" if is_oom(exc) else "error", "stage": stage, "error": short_error(exc)}


def clear_grad(*tensors) -> None:
    for x in tensors:
        x.grad = None


def measure(make: Callable, e, c, t, *, device, ref=None, mem_key: str, trace: bool = False):
    """All of one method but its time: loss_fn = make(); one forward + backward (compiles, autotunes)
    for the loss and, with ref = fp32 (loss, ∇e, ∇c), its errors; res[mem_key] the peak_bytes of
    another. The first failure is recorded with its stage (and traceback, with trace); a fatal CUDA
    error raises FatalCudaError (.result: what was recorded). Returns (res, loss_fn or None)."""
    res: dict = {"status": "ok"}
    stage, fn = "build", None
    clear_grads = functools.partial(clear_grad, e, c)
    try:
        fn = make()

        def fwd_bwd():
            loss = fn(e, c, t)
            loss.backward()
            return loss

        stage = "accuracy"
        clear_grads()
        loss = fwd_bwd()
        sync(device)
        res["loss"] = float(loss.detach().float())
        if ref is not None:
            res["loss_rel_err"] = abs(res["loss"] - ref[0]) / abs(ref[0])
            res["grad_e_rel_err"] = rel_err(e.grad.reshape(-1, e.shape[-1]), ref[1]) if e.grad is not None else None
            res["grad_c_rel_err"] = rel_err(c.grad, ref[2]) if c.grad is not None else None
        del loss
        clear_grads()
        stage = "fwd+bwd memory"
        res[mem_key] = peak_bytes(fwd_bwd, device=device)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the run goes on
        res.update(failure(exc, stage))
        if trace:
            res["traceback"] = traceback.format_exc(limit=8)
        if is_fatal_cuda_error(exc):
            fatal = FatalCudaError(res["error"])
            fatal.result = res
            raise fatal from None
    finally:
        clear_grads()
        free_memory(device)
    return res, (fn if res["status"] == "ok" else None)


def time_fwd_bwd(alive: list, e, c, t, args, *, device, flops: float, tflops_key: str,
                 paired_to: str | None = None, extra: list = ()) -> None:
    """Forward + backward time of every (res, loss_fn) in `alive` side by side (time_in_rounds, fresh
    gradients each call) into res["fwd_bwd"] and res[tflops_key]; with paired_to, fwd_bwd's
    vs_<paired_to>_paired: the paired_ratio to the res whose "key" it is. `extra`: more (res, name, fn)
    timed in the same rounds, fn() a whole timed unit (a forward alone, or one with its own backward), its
    times into res[name]. After a fatal CUDA error, FatalCudaError once every result is recorded."""
    calls = [(i, lambda fn=fn: fn(e, c, t).backward()) for i, (_, fn) in enumerate(alive)]
    calls += [(len(alive) + j, fn) for j, (_, _, fn) in enumerate(extra)]
    timed = time_in_rounds(calls, device=device, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds,
                           setup=functools.partial(clear_grad, e, c))
    ref = next((timed[i][0] for i, (r, _) in enumerate(alive) if r.get("key") == paired_to), [])
    fatal, rows = None, [(res, "fwd_bwd") for res, _ in alive] + [(res, name) for res, name, _ in extra]
    for i, (times, exc) in timed.items():
        res, name = rows[i]
        if exc is not None:
            res.update(failure(exc, name.replace("_", "+")))
            fatal = fatal or (res["error"] if is_fatal_cuda_error(exc) else None)
            continue
        if not times:  # a fatal error elsewhere stopped the rounds first
            continue
        res[name] = summarize_times(times)
        if i >= len(alive):
            continue
        res[tflops_key] = flops / (res["fwd_bwd"]["median_ms"] * 1e-3) / 1e12
        if paired_to:  # round by round (None where a round is short)
            res["fwd_bwd"][f"vs_{paired_to}_paired"] = paired_ratio(times, ref, round_sizes(args.repeats, args.rounds))
    if fatal is not None:
        raise FatalCudaError(fatal)


@torch.no_grad()
def matmul_ms(shape: Shape, *, device, dtype=torch.bfloat16, warmup=3, repeats=10, seed=0) -> dict:
    """cuBLAS (torch.mm) time of the logits product [N, D] @ [D, V] into a preallocated output."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    a = torch.randn(shape.N, shape.D, device=device, generator=gen).to(dtype)
    b = (torch.randn(shape.V, shape.D, device=device, generator=gen) * C_INIT_STD).to(dtype)
    out = torch.empty(shape.N, shape.V, device=device, dtype=dtype)
    med = statistics.median(time_ms(lambda: torch.mm(a, b.T, out=out), device=device, warmup=warmup,
                                    repeats=repeats))
    return {"ms": med, "tflops": 2.0 * shape.N * shape.V * shape.D / (med * 1e-3) / 1e12}


def run_guarded(body: Callable[[], None], data: dict, where: str = "") -> int:
    """body(); a fatal CUDA error (exit status 3) or any other exception (4, its traceback printed)
    stops it and is recorded in data["aborted"], so that what was measured is still written."""
    try:
        body()
        return 0
    except FatalCudaError as exc:
        data["aborted"], rc = f"fatal CUDA error{where}, run stopped: {exc}", 3
    except Exception as exc:  # noqa: BLE001 - a bug here must not lose what was measured
        traceback.print_exc()
        data["aborted"], rc = f"unexpected error{where}, run stopped: {short_error(exc)}", 4
    print(data["aborted"], file=sys.stderr, flush=True)
    return rc


# ---- Metadata and output -------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', else a slug of the whole name."""
    low = name.lower()
    if low.startswith("cpu"):
        return "cpu"
    for tok in re.split(r"[^a-z0-9]+", low.replace("nvidia", " ")):
        if re.fullmatch(r"[a-z]+\d+[a-z]*", tok):
            return tok
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown"


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git, not a repo: say "unknown"
        return "unknown"


def pkg_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_metadata(device, args, methods: list, packages: tuple, tag: str, **extra) -> dict:
    """What a bench_loss / bench_tp result records of its run (`extra` after the machine's), its
    methods printed."""
    name = torch.cuda.get_device_name(device) if is_cuda(device) else (
        f"CPU ({platform.processor() or platform.machine()})")
    for m in methods:
        print(f"[{tag}] method {m.key:<24} {m.label}" + (f"  UNAVAILABLE: {m.unavailable}" if m.unavailable else ""),
              flush=True)
    return {"device": name, "gpu": gpu_slug(name), "torch": torch.__version__, "triton": pkg_version("triton"),
            "cuda": torch.version.cuda, "python": platform.python_version(), "git_commit": args.commit or git_commit(),
            "date": utc_now(), "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "hostname": platform.node(),
            "env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET") if k in os.environ},
            **extra, "warmup": args.warmup, "repeats": args.repeats, "rounds": args.rounds,
            "regimes": {r: REGIMES[r] for r in args.regimes},
            "methods": {m.key: {"label": m.label, "unavailable": m.unavailable, **getattr(m, "info", {})} for m in methods},
            "packages": {n: pkg_version(n) for n in packages}}


def out_stem(out_dir: Path, meta: dict, tag: str | None) -> Path:
    return Path(out_dir) / (f"{meta['gpu']}_{meta['date'][:10].replace('-', '')}" + (f"_{tag}" if tag else ""))


def _clean(o):
    """Strict JSON: non-finite floats become their name as a string ("nan", "inf")."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return str(o) if isinstance(o, (torch.dtype, Path)) else o


def write_report(stem: Path, data: dict, markdown: str) -> list[str]:
    """stem.json (strict JSON, without the keys that start with _, written atomically) and stem.md;
    their paths."""
    path = stem.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean({k: v for k, v in data.items() if not str(k).startswith("_")}), indent=1,
                              allow_nan=False) + "\n")
    tmp.replace(path)
    stem.with_suffix(".md").write_text(markdown)
    return [str(path), str(stem.with_suffix(".md"))]


def get(r, *path):
    """r[path[0]][path[1]]... as a float (a non-finite one stored as its name read back), None where
    any step is missing."""
    for p in path:
        if not isinstance(r, dict):
            return None
        r = r.get(p)
    if isinstance(r, str):
        try:
            return float(r)
        except ValueError:
            return None
    return r


def fmt_num(x, spec: str = ".1f", missing: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return format(x, spec)


def fmt_mib(b, missing: str = "–") -> str:
    if b is None:
        return missing
    mib = b / MiB
    return f"{mib:.1f}" if mib < 10 else f"{mib:,.0f}"


def md_table(header: list[str], rows) -> list[str]:
    """The lines of a Markdown table: the header, its rule, a line per row of cells (| becomes /)."""
    def row(cells):
        return "| " + " | ".join(str(x).replace("|", "/") for x in cells) + " |"

    return [row(header), "|" + "---|" * len(header), *map(row, rows)]


def expand_ours(key: str, impls: list[str]) -> list[tuple[str, str, str | None, object]]:
    """``ours[:<impl>[@<budget>]]`` as (key, impl, budget text, logits_budget),
    one per impl: without an impl every impl of `impls` but torch. The budget: "lean", "auto" (the
    default), bytes, or <n>g / <n>m."""
    prefix, _, spec = key.partition(":")
    impl, _, text = spec.partition("@")
    budget: object = text or "auto"
    if text and text not in ("lean", "auto"):
        mult = {"g": 1 << 30, "m": 1 << 20}.get(text[-1:].lower(), 1)
        try:
            budget = int(float(text[:-1] if mult > 1 else text) * mult)
        except ValueError:
            raise SystemExit(f"bad logits budget {text!r} in method {key!r}: lean, auto, bytes, <n>g or <n>m") from None
    return [(f"{prefix}:{i}" + (f"@{text}" if text else ""), i, text or None, budget)
            for i in ([impl] if impl else [i for i in impls if i != "torch"])]
