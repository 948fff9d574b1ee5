"""How fast, how lean and how accurate is the loss + gradient on one GPU, next to the peers?

For each (shape, regime) this script builds bf16 inputs E [N, D], C [V, D] and targets [N], then
for each method measures, in one process:

- forward time (median of --repeats after --warmup, CUDA events, fresh gradients every iteration,
  reduction "mean"), and forward + backward time taken in --rounds rounds that run every method
  in turn (the card's clocks drift by up to 20 % within a series of calls, so measuring the methods
  one after another favoured whichever ran first);
- peak memory above the inputs, for the forward alone and for forward + backward, next to the
  lower bound (the bytes of ∇E + ∇C);
- achieved TFLOP/s, counting 2·N·V·D for the forward and 6·N·V·D for forward + backward
  (no credit for recomputing the logits), and the forward against a cuBLAS matmul of the logits;
- loss, ∇E and ∇C relative error (Frobenius) against an fp32 reference computed, chunked, from
  the same bf16 inputs upcast.

Methods: torch eager, torch.compile of the same function, liger-kernel FLCE, cut-cross-entropy
(impl "cce"), torch.nn.functional.linear_cross_entropy (where torch has it) and every Triton impl of
cce_parallel. Missing peers are recorded as "unavailable"; OOM and errors are recorded per method.

Results: <out>/<gpu>_<yyyymmdd>[_<tag>].{json,md,png}; the JSON is rewritten after every case,
so a run cut short still leaves what it measured. Run with --help for the options;
--cpu-smoke runs a tiny CPU version to test the plumbing.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _common as C
import torch
import torch.nn.functional as F

DEFAULT_METHODS = "eager,compile,liger,cutce,torch_lce,ours"
DEFAULT_SWEEP = "1024,2048,4096,8192,16384,32768,65536"
SMOKE_SWEEP = "16,32,64"
FLOP_CONVENTION = (
    "forward: 2·N·V·D FLOPs; forward+backward: 6·N·V·D FLOPs (logits, ∇E, ∇C), no credit for "
    "recomputing the logits"
)
MEMORY_CONVENTION = (
    "peak torch.cuda.max_memory_allocated above memory_allocated just before the call, "
    "in MiB (2^20 B); the lower bound is the bytes of ∇E + ∇C"
)


class FatalCudaError(RuntimeError):
    """The CUDA context is broken (illegal access, device assert): nothing more can run."""


# ----------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------


def eager_loss(e: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(e, c).float(), t, reduction="mean")


@dataclass
class Method:
    key: str  # short, used on the command line and in the printed table
    label: str  # long, used in the Markdown table and the plot
    make: Callable[[], Callable] | None = None  # builds loss_fn(e, c, t) for one case
    unavailable: str | None = None
    info: dict = field(default_factory=dict)


def _make_compile():
    import torch._dynamo

    # A fresh compile per case, static shapes: no recompile limits, no dynamic-shape kernels.
    torch._dynamo.reset()
    return torch.compile(eager_loss, dynamic=False)


UPSTREAMS = {
    "masked": "x loss_mask / count, the mask folded into ignore_index (Megatron's way, 10 % masked)",
    "folded": "summed / count, the mask folded into ignore_index (the train job's way, 10 % masked)",
    "unfolded": "x loss_mask / count, the mask not folded into ignore_index (10 % masked)",
    "weighted": "x random per-token weights / N",
}


def _per_token(per_token_fn, upstream: str):
    """A mean-like scalar from a per-token loss: Megatron's loss_mask / count, or random weights."""
    cache: dict = {}

    def loss(e, c, t):
        if t not in cache:  # fixed per input set, made outside the timed region after the first call
            cache.clear()
            g = torch.Generator(t.device).manual_seed(1)
            cache[t] = torch.rand(t.shape, device=t.device, generator=g)
        r = cache[t]
        if upstream == "unfolded":
            mask = (r >= 0.1).float()
            return (per_token_fn(e, c, t) * mask).sum() / mask.sum()
        if upstream in ("masked", "folded"):
            mask = (r >= 0.1).float()
            # cce_parallel.megatron.mask_labels (inlined: megatron-core need not be installed here)
            per_token = per_token_fn(e, c, t.masked_fill(mask == 0, -100))
            # folded: masked tokens' losses are 0, so the plain sum is the masked one (train.trainer.loss_func)
            return (per_token.sum() if upstream == "folded" else (per_token * mask).sum()) / mask.sum()
        return (per_token_fn(e, c, t) * r).sum() / t.numel()

    return loss


def build_methods(keys: list[str], include_torch_impl: bool, baseline=None) -> list[Method]:
    """baseline: the package that `base[:...]` methods call (C.import_baseline), or None."""
    out: list[Method] = []
    for key in keys:
        if key == "eager":
            out.append(Method("eager", "torch eager", lambda: eager_loss))
        elif key == "compile":
            out.append(Method("compile", "torch.compile", _make_compile))
        elif key == "liger":
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

                def make_liger(cls=LigerFusedLinearCrossEntropyLoss):
                    mod = cls(reduction="mean")
                    return lambda e, c, t: mod(c, e, t)  # liger takes (weight, input, target)

                ver = C.pkg_version("liger-kernel")
                out.append(Method("liger", f"liger-kernel {ver} FLCE", make_liger, info={"version": ver}))
            except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
                out.append(Method("liger", "liger-kernel FLCE", unavailable=C.short_error(exc)))
        elif key == "cutce":
            try:
                from cut_cross_entropy import linear_cross_entropy as cut_lce

                def make_cut(fn=cut_lce):
                    return lambda e, c, t: fn(e, c, t, impl="cce", reduction="mean")

                ver = C.pkg_version("cut-cross-entropy")
                out.append(Method("cutce", f"cut-cross-entropy {ver} (cce)", make_cut, info={"version": ver}))
            except Exception as exc:  # noqa: BLE001
                out.append(Method("cutce", "cut-cross-entropy (cce)", unavailable=C.short_error(exc)))
        elif key == "torch_lce":
            fn = getattr(F, "linear_cross_entropy", None)
            if fn is None:
                out.append(
                    Method(
                        "torch_lce",
                        "F.linear_cross_entropy",
                        unavailable=f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy",
                    )
                )
                continue
            sig = str(inspect.signature(fn))
            opts_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
            kwargs = {"reduction": "mean"}
            mode = "reference path"
            if opts_cls is not None and "options" in inspect.signature(fn).parameters:
                kwargs["options"] = opts_cls()  # the chunked path, with its "auto" policy
                mode = "chunked, LinearCrossEntropyOptions()"

            def make_tlce(fn=fn, kwargs=kwargs):
                return lambda e, c, t: fn(e, c, t, **kwargs)

            out.append(
                Method(
                    "torch_lce",
                    f"F.linear_cross_entropy ({mode})",
                    make_tlce,
                    info={"signature": sig, "mode": mode},
                )
            )
        elif key in ("ours", "base") or key.startswith(("ours:", "base:")):
            prefix = key.split(":", 1)[0].split("/", 1)[0]
            if prefix == "base":
                if baseline is None:
                    raise SystemExit(f"method {key!r} needs --baseline")
                cce_parallel = baseline
            else:
                try:
                    import cce_parallel
                except Exception as exc:  # noqa: BLE001
                    out.append(Method(key, "cce_parallel", unavailable=C.short_error(exc)))
                    continue
            package = cce_parallel.__name__
            if not hasattr(cce_parallel, "linear_cross_entropy"):
                where = getattr(cce_parallel, "__path__", None) or getattr(cce_parallel, "__file__", "?")
                out.append(
                    Method(key, "cce_parallel", unavailable=f"no linear_cross_entropy in {list(where)}")
                )
                continue
            impls = list(getattr(cce_parallel, "IMPLS", ()))
            key_spec, _, upstream = key.partition("/")
            if upstream not in ("", *UPSTREAMS):
                raise SystemExit(f"unknown upstream {upstream!r} in {key!r}: {', '.join(UPSTREAMS)}")
            upstream = upstream or None
            impl_part, budget_part, budget = C.parse_ours(key_spec)
            if not impl_part:
                wanted = [i for i in impls if i != "torch" or include_torch_impl]
            else:
                wanted = [impl_part]
            for impl in wanted:
                mkey = f"{prefix}:{impl}" + (f"@{budget_part}" if budget_part else "") + (f"/{upstream}" if upstream else "")
                if any(m.key == mkey for m in out):
                    continue
                if impl not in impls:
                    out.append(Method(mkey, f"{package} {impl}", unavailable=f"not in IMPLS {impls}"))
                    continue

                def make_ours(impl=impl, budget=budget, upstream=upstream, fn=cce_parallel.linear_cross_entropy,
                              package=package):
                    # Each method and case runs as in a fresh process of its own: a per-token-weighted
                    # backward makes later reduction="none" calls take the lean path (ops/upstream.py),
                    # a process-wide switch that must not carry over into /masked (the methods take
                    # turns in the timing rounds). So each call sets it as this method alone would
                    # have: on for /weighted after its first call, off otherwise; likewise the switch
                    # to fp32 gradients that /unfolded's first bf16 backward sets (masked_weights_seen).
                    try:  # where the process-wide switches live (ops/autograd.py in older baselines)
                        learned = importlib.import_module(f"{package}.ops.upstream")
                    except ImportError:
                        learned = importlib.import_module(f"{package}.ops.autograd")
                    if upstream is None:
                        base = lambda e, c, t: fn(e, c, t, impl=impl, reduction="mean", logits_budget=budget)  # noqa: E731
                    else:
                        base = _per_token(
                            lambda e, c, t: fn(e, c, t, impl=impl, reduction="none", logits_budget=budget), upstream
                        )
                    calls = [0]

                    def loss(e, c, t):
                        learned.per_token_weights_seen = upstream == "weighted" and calls[0] > 0
                        if hasattr(learned, "masked_weights_seen"):  # a baseline package may predate it
                            learned.masked_weights_seen = upstream == "unfolded" and calls[0] > 0
                        calls[0] += 1
                        return base(e, c, t)

                    return loss

                label = f"{package} {impl}" + (f" @{budget_part}" if budget_part else "") + (
                    f", per-token loss {UPSTREAMS[upstream]}" if upstream else ""
                )
                info = {"impl": impl, "logits_budget": budget, "upstream": upstream}
                out.append(Method(mkey, label, make_ours, info=info))
        else:
            raise SystemExit(
                f"unknown method {key!r}; known: eager, compile, liger, cutce, torch_lce, ours, ours:<impl>, "
                "base, base:<impl>"
            )
    return out


# ----------------------------------------------------------------------------------------------
# Measuring one method on one case
# ----------------------------------------------------------------------------------------------


def measure_method(m: Method, e, c, t, ref, mm: dict | None, shape: C.Shape, args, device):
    """Run every measurement of one method but its forward + backward time (interleaved_fwd_bwd
    takes that); record the first failure and keep what came before. Returns (result, loss_fn or
    None when it failed)."""
    res: dict = {"key": m.key, "label": m.label, "status": "ok"}
    if m.unavailable:
        return {**res, "status": "unavailable", "error": m.unavailable}, None

    def clear_grads():
        e.grad = None
        c.grad = None

    stage = "build"
    fn = None
    try:
        fn = m.make()

        def fwd():
            return fn(e, c, t)

        def fwd_bwd():
            loss = fn(e, c, t)
            loss.backward()
            return loss

        flops_f = 2.0 * shape.N * shape.V * shape.D

        # Accuracy first: it is also the first (compiling / autotuning) call.
        stage = "accuracy"
        clear_grads()
        loss = fwd_bwd()
        C.sync(device)
        res["loss"] = float(loss.detach().float())
        if ref is not None and not m.info.get("upstream"):  # the reference is the plain mean
            ref_loss, ref_ge, ref_gc = ref
            res["loss_rel_err"] = abs(res["loss"] - ref_loss) / abs(ref_loss)
            res["grad_e_rel_err"] = C.rel_err(e.grad, ref_ge) if e.grad is not None else None
            res["grad_c_rel_err"] = C.rel_err(c.grad, ref_gc) if c.grad is not None else None
        del loss
        clear_grads()

        stage = "fwd"
        times = C.time_ms(fwd, device=device, warmup=args.warmup, repeats=args.repeats, setup=clear_grads)
        res["fwd"] = C.summarize_times(times)
        res["fwd_tflops"] = flops_f / (res["fwd"]["median_ms"] * 1e-3) / 1e12
        if mm is not None:
            res["fwd_vs_matmul"] = mm["ms"] / res["fwd"]["median_ms"]
        stage = "fwd memory"
        clear_grads()
        res["fwd_mem_bytes"] = C.peak_bytes(fwd, device=device)
        clear_grads()

        stage = "fwd+bwd memory"
        clear_grads()
        res["fwd_bwd_mem_bytes"] = C.peak_bytes(fwd_bwd, device=device)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the run goes on
        res["status"] = "oom" if C.is_oom(exc) else "error"
        res["stage"] = stage
        res["error"] = C.short_error(exc)
        if C.is_fatal_cuda_error(exc):
            fatal = FatalCudaError(res["error"])
            fatal.result = res
            raise fatal from None
    finally:
        clear_grads()
        C.free_memory(device)
    return res, (fn if res["status"] == "ok" else None)


def interleaved_fwd_bwd(alive: list, e, c, t, shape: C.Shape, args, device, results: dict) -> None:
    """Forward + backward time of every method in `alive` [(key, loss_fn)], side by side in
    --rounds rounds (C.time_in_rounds), --repeats timed calls each; into results[key]["fwd_bwd"]."""

    def clear_grads():
        e.grad = None
        c.grad = None

    calls = [(key, lambda fn=fn: fn(e, c, t).backward()) for key, fn in alive]
    timed = C.time_in_rounds(
        calls, device=device, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds, setup=clear_grads
    )
    flops_fb = 6.0 * shape.N * shape.V * shape.D
    sizes = C.round_sizes(args.repeats, args.rounds)
    ref = timed.get("compile", ([], None))[0]
    for key, (times, exc) in timed.items():
        res = results[key]
        if exc is not None:
            res.update(status="oom" if C.is_oom(exc) else "error", stage="fwd+bwd", error=C.short_error(exc))
            if C.is_fatal_cuda_error(exc):
                raise FatalCudaError(res["error"])
        else:
            res["fwd_bwd"] = C.summarize_times(times)
            res["fwd_bwd_tflops"] = flops_fb / (res["fwd_bwd"]["median_ms"] * 1e-3) / 1e12
            # Against torch.compile round by round (None without it or where a round is short).
            res["fwd_bwd"]["vs_compile_paired"] = C.paired_ratio(times, ref, sizes)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str  # "main" or "sweep"
    shape: C.Shape
    regime: str

    @property
    def key(self) -> tuple:
        return (self.kind, self.shape.name, self.shape.N, self.regime)


def run_case(case: Case, methods: list[Method], args, device, dtype, seed: int, deadline, sink: list) -> None:
    """Measure one case; its dict goes into ``sink`` first, so a fatal error keeps what was measured."""
    shape = case.shape
    elem = torch.finfo(dtype).bits // 8
    out = {
        "kind": case.kind,
        "shape": shape.name,
        "N": shape.N,
        "V": shape.V,
        "D": shape.D,
        "regime": case.regime,
        "dtype": str(dtype).replace("torch.", ""),
        "seed": seed,
        "lower_bound_bytes": (shape.N * shape.D + shape.V * shape.D) * elem,
        "input_bytes": (shape.N * shape.D + shape.V * shape.D) * elem + shape.N * 8,
        "methods": {},
    }
    sink.append(out)
    t0 = time.perf_counter()
    C.free_memory(device)
    e = c = t = ref = mm = None
    stage = "inputs"
    try:
        e, c, t = C.make_inputs(
            shape, case.regime, dtype=dtype, device=device, seed=seed
        )
        stage = "softmax stats"
        out["softmax"] = C.softmax_stats(e, c, t, rows=args.stats_rows)
        if not args.no_errors:
            stage = "fp32 reference"
            ref = C.reference_loss_grads(e, c, t)
            out["ref_loss"] = ref[0]
        C.free_memory(device)
        stage = "cuBLAS matmul"
        mm = C.matmul_ms(shape, device=device, dtype=dtype, warmup=args.warmup, repeats=args.repeats)
        out["matmul"] = mm
    except Exception as exc:  # noqa: BLE001 - e.g. OOM of the reference at a large N: say so, go on
        out.setdefault("setup_errors", {})[stage] = C.short_error(exc)
        print(f"  setup {stage}: {C.short_error(exc, 160)}", flush=True)
        if C.is_fatal_cuda_error(exc):
            raise FatalCudaError(str(exc)) from None
        if e is None:  # no inputs: nothing can be measured
            out["status"] = "oom" if C.is_oom(exc) else "error"
            return
        if stage == "fp32 reference":
            ref = None
    C.free_memory(device)
    out["setup_s"] = time.perf_counter() - t0

    e.requires_grad_(True)
    c.requires_grad_(True)
    alive = []
    for m in methods:
        if deadline is not None and time.monotonic() > deadline:
            out["methods"][m.key] = {
                "key": m.key,
                "label": m.label,
                "status": "skipped",
                "error": "time budget",
            }
            continue
        t1 = time.perf_counter()
        try:
            res, fn = measure_method(m, e, c, t, ref, mm, shape, args, device)
        except FatalCudaError as exc:
            out["methods"][m.key] = exc.result
            print(progress_line(case, exc.result), flush=True)
            raise
        res["wall_s"] = time.perf_counter() - t1
        out["methods"][m.key] = res
        if fn is not None:
            alive.append((m.key, fn))
    t1 = time.perf_counter()
    try:
        interleaved_fwd_bwd(alive, e, c, t, shape, args, device, out["methods"])
    finally:
        for key, _ in alive:
            out["methods"][key]["wall_s"] += (time.perf_counter() - t1) / len(alive)
        for m in methods:
            if m.key in out["methods"]:
                print(progress_line(case, out["methods"][m.key]), flush=True)
        del alive
    del e, c, t, ref
    C.free_memory(device)


def progress_line(case: Case, r: dict) -> str:
    head = f"  {case.shape.name}/{case.regime} N={case.shape.N:<6} {r['key']:<22}"
    if r["status"] != "ok" and "fwd" not in r:
        return f"{head} {r['status']}: {r.get('stage', '')} {r.get('error', '')[:120]}"
    parts = [
        f"fwd {C.fmt_num(r.get('fwd', {}).get('median_ms'), '.2f')} ms",
        f"f+b {C.fmt_num(r.get('fwd_bwd', {}).get('median_ms'), '.2f')} ms",
        f"mem {C.fmt_mib(r.get('fwd_mem_bytes'))}/{C.fmt_mib(r.get('fwd_bwd_mem_bytes'))} MiB",
        f"dE {C.fmt_err(r.get('grad_e_rel_err'))} dC {C.fmt_err(r.get('grad_c_rel_err'))}",
        f"({r.get('wall_s', 0):.0f} s)",
    ]
    tail = "" if r["status"] == "ok" else f" [{r['status']} at {r.get('stage')}: {r.get('error', '')[:80]}]"
    return f"{head} " + "  ".join(parts) + tail


# ----------------------------------------------------------------------------------------------
# Reports: Markdown, compact text, plot (all from the JSON data, so --render can redo them)
# ----------------------------------------------------------------------------------------------


def _get(r: dict, *path):
    for p in path:
        if not isinstance(r, dict):
            return None
        r = r.get(p)
    return C.as_float(r)


def _method_order(cases: list[dict]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for cs in cases:
        for k, r in cs["methods"].items():
            seen.setdefault(k, r.get("label", k))
    return list(seen.items())


def _case_header(cs: dict) -> str:
    sm = cs.get("softmax", {})
    mm = cs.get("matmul", {})
    bits = [
        f"lower bound {C.fmt_mib(cs['lower_bound_bytes'])} MiB",
        (
            f"softmax entries ≥ 2^-12: {100 * (_get(sm, 'frac_ge_eps') or 0):.4f} % "
            f"({C.fmt_num(_get(sm, 'entries_ge_eps_per_row'), '.1f')} per row)"
        ),
        f"median p(target) {C.fmt_num(_get(sm, 'p_target_median'), '.3f')}",
        f"fp32 loss {C.fmt_num(_get(cs, 'ref_loss'), '.4f')}",
    ]
    if "ms" in mm:
        bits.append(f"cuBLAS logits matmul {mm['ms']:.2f} ms ({mm['tflops']:.0f} TFLOP/s)")
    return " · ".join(bits)


def over_base_paired(cs: dict, meta: dict) -> list[tuple[str, str, float]]:
    """(method, its base method, ratio) for every method with an upstream variant (`.../masked`)
    whose base (the same method with the plain mean) ran in the same rounds: the median over the
    rounds of the round's fwd+bwd median over the base's (C.paired_ratio), from the stored call
    times, so that older reports render it too. Criterion: Megatron's mask within 5 % of the mean."""
    sizes = C.round_sizes(meta.get("repeats") or 0, meta.get("rounds") or 1)
    out = []
    for key, r in cs["methods"].items():
        base = key.rsplit("/", 1)[0]
        if "/" not in key or base not in cs["methods"]:
            continue
        times = (r.get("fwd_bwd") or {}).get("times_ms")
        ref = (cs["methods"][base].get("fwd_bwd") or {}).get("times_ms")
        ratio = C.paired_ratio(times, ref, sizes) if times and ref else None
        if ratio is not None:
            out.append((key, base, ratio))
    return out


def render_markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        "# Loss + gradient on one GPU: cce_parallel next to its peers",
        "",
        (
            f"- device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
            f"CUDA {meta.get('cuda')}, Python {meta.get('python')}"
        ),
    ]
    if meta.get("sources"):
        lines.append(f"- merged from: {'; '.join(meta['sources'])} (each file's command is in its own report)")
    else:
        lines += [f"- commit: `{meta['git_commit']}`; date: {meta['date']}", f"- command: `{meta['command']}`"]
    sq = data.get("square_matmul")
    if sq and "tflops" in sq:
        lines.append(f"- cuBLAS bf16 {sq['n']}³ matmul: {sq['tflops']:.0f} TFLOP/s")
    lines += [
        (
            f"- timing: median of {meta.get('repeats')} after {meta.get('warmup')} warm-up calls (and one "
            "accuracy call), CUDA events (perf_counter on a CPU), fresh gradients each call, reduction 'mean'; "
            f"forward + backward in {meta.get('rounds', 1)} rounds over all methods, one warm-up call per "
            "method in each later round"
        ),
        f"- FLOPs: {FLOP_CONVENTION}",
        f"- memory: {MEMORY_CONVENTION}",
        "- errors: ‖x − ref‖_F / ‖ref‖_F against an fp32 reference from the same inputs upcast",
        "- fwd ×mm: cuBLAS matmul time of the logits over the method's forward time (target ≥ 0.7)",
        (
            "- fwd+bwd ×compile, paired: per round, the method's median fwd+bwd time over torch.compile's in "
            "that round; the median of those ratios over the rounds (a clock drifting between rounds cancels)"
        ),
        "",
        "Regimes:",
    ]
    for r in sorted({cs["regime"] for cs in data["cases"]}):
        lines.append(f"- **{r}**: {C.REGIMES.get(r, '?')}")
    lines.append("")
    unavailable = {}
    for cs in data["cases"]:
        for k, r in cs["methods"].items():
            if r.get("status") == "unavailable":
                unavailable[k] = r.get("error", "")
    if unavailable:
        lines.append("Unavailable: " + "; ".join(f"`{k}` ({v})" for k, v in unavailable.items()))
        lines.append("")

    main = [cs for cs in data["cases"] if cs["kind"] == "main"]
    if main:
        lines.append("## Model shapes")
        lines.append("")
    for cs in main:
        lines.append(f"### {cs['shape']} (N={cs['N']}, V={cs['V']}, D={cs['D']}), {cs['regime']}")
        lines.append("")
        lines.append(_case_header(cs))
        lines.append("")
        lines.append(
            "| method | fwd ms | fwd MiB | fwd+bwd ms | fwd+bwd ×compile, paired | fwd+bwd MiB | fwd TFLOP/s "
            "| fwd ×mm | fwd+bwd TFLOP/s | loss err | ∇E err | ∇C err | status |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for k, r in cs["methods"].items():
            if r.get("status") == "unavailable":
                continue
            status = r.get("status", "?")
            if status != "ok":
                where = f" ({r['stage']})" if r.get("stage") else ""
                status = f"{status}{where}: {r.get('error', '')[:100]}"
            lines.append(
                "| "
                + " | ".join(
                    [
                        r.get("label", k),
                        C.fmt_num(_get(r, "fwd", "median_ms"), ".2f"),
                        C.fmt_mib(_get(r, "fwd_mem_bytes")),
                        C.fmt_num(_get(r, "fwd_bwd", "median_ms"), ".2f"),
                        C.fmt_num(_get(r, "fwd_bwd", "vs_compile_paired"), ".3f"),
                        C.fmt_mib(_get(r, "fwd_bwd_mem_bytes")),
                        C.fmt_num(_get(r, "fwd_tflops"), ".0f"),
                        C.fmt_num(_get(r, "fwd_vs_matmul"), ".2f"),
                        C.fmt_num(_get(r, "fwd_bwd_tflops"), ".0f"),
                        C.fmt_err(_get(r, "loss_rel_err")),
                        C.fmt_err(_get(r, "grad_e_rel_err")),
                        C.fmt_err(_get(r, "grad_c_rel_err")),
                        status.replace("|", "/"),
                    ]
                )
                + " |"
            )
        lines.append("")
        paired = over_base_paired(cs, meta)
        for key, base, ratio in paired:
            lines.append(f"- fwd+bwd of `{key}` over `{base}`'s, paired: {ratio:.3f}")
        if paired:
            lines.append("")

    sweep = [cs for cs in data["cases"] if cs["kind"] == "sweep"]
    if sweep:
        lines.append(f"## Token sweep on {sweep[0]['shape']} (V={sweep[0]['V']}, D={sweep[0]['D']})")
        lines.append("")
        methods = _method_order(sweep)
        methods = [
            (k, lab)
            for k, lab in methods
            if any(cs["methods"].get(k, {}).get("status") != "unavailable" for cs in sweep)
        ]
        for regime in dict.fromkeys(cs["regime"] for cs in sweep):
            rows = [cs for cs in sweep if cs["regime"] == regime]
            lines.append(f"### {regime}: fwd+bwd ms / fwd+bwd MiB (OOM, err: failed)")
            lines.append("")
            lines.append(
                "| N | lower bound MiB | cuBLAS mm ms | " + " | ".join(lab for _, lab in methods) + " |"
            )
            lines.append("|---|---|---|" + "---|" * len(methods))
            for cs in sorted(rows, key=lambda x: x["N"]):
                cells = []
                for k, _ in methods:
                    r = cs["methods"].get(k, {})
                    ms = _get(r, "fwd_bwd", "median_ms")
                    if ms is None:
                        cells.append({"oom": "OOM", "error": "err"}.get(r.get("status"), "–"))
                    else:
                        cells.append(f"{ms:.1f} / {C.fmt_mib(_get(r, 'fwd_bwd_mem_bytes'))}")
                lines.append(
                    f"| {cs['N']} | {C.fmt_mib(cs['lower_bound_bytes'])} | "
                    f"{C.fmt_num(_get(cs, 'matmul', 'ms'), '.2f')} | " + " | ".join(cells) + " |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def _e(x) -> str:
    """Compact relative error: 2.4e-3."""
    x = C.as_float(x)
    if x is None or not math.isfinite(x):
        return "-"
    if x == 0:
        return "0"
    m, ex = f"{x:.1e}".split("e")
    return f"{m}e{int(ex)}"


def render_compact(data: dict) -> str:
    """A short plain-text table for the end of the log (the device tool shows its last 12k chars)."""
    meta = data["meta"]
    lines = [
        f"== {meta['device']} | torch {meta['torch']} triton {meta['triton']} | {meta['git_commit'][:12]}",
        "   ms: median; MiB: peak above inputs; TF: f+b TFLOP/s at 6NVD; xmm: mm/fwd time; dE dC: rel err vs fp32",
    ]
    unavailable = sorted(
        {k for cs in data["cases"] for k, r in cs["methods"].items() if r.get("status") == "unavailable"}
    )
    if unavailable:
        lines.append("   unavailable: " + ", ".join(unavailable))
    main = [cs for cs in data["cases"] if cs["kind"] == "main"]
    if main:
        lines.append(
            f"   {'method':<22}{'fwd ms':>8}{'f+b ms':>8}{'fwdMiB':>7}{'f+bMiB':>7}{'TF':>5}{'xmm':>6}"
            f"{'dE':>8}{'dC':>8}"
        )
    for cs in main:
        sm = cs.get("softmax", {})
        mm = cs.get("matmul", {})
        lines.append(
            f"-- {cs['shape']} {cs['regime']} N={cs['N']} V={cs['V']} D={cs['D']} "
            f"lb={C.fmt_mib(cs['lower_bound_bytes'])}MiB >=eps:{_e(_get(sm, 'frac_ge_eps'))} "
            f"mm={C.fmt_num(_get(mm, 'ms'), '.2f')}ms/{C.fmt_num(_get(mm, 'tflops'), '.0f')}TF"
            + (f" setup errors: {cs['setup_errors']}" if cs.get("setup_errors") else "")
        )
        for k, r in cs["methods"].items():
            st = r.get("status")
            if st == "unavailable":
                continue
            if st != "ok" and _get(r, "fwd", "median_ms") is None:
                where = f" at {r['stage']}" if r.get("stage") else ""
                lines.append(f"   {k:<22}{st}{where}: {r.get('error', '')[:70]}")
                continue
            lines.append(
                f"   {k:<22}"
                f"{C.fmt_num(_get(r, 'fwd', 'median_ms'), '.2f'):>8}"
                f"{C.fmt_num(_get(r, 'fwd_bwd', 'median_ms'), '.2f'):>8}"
                f"{C.fmt_mib(_get(r, 'fwd_mem_bytes')):>7}"
                f"{C.fmt_mib(_get(r, 'fwd_bwd_mem_bytes')):>7}"
                f"{C.fmt_num(_get(r, 'fwd_bwd_tflops'), '.0f'):>5}"
                f"{C.fmt_num(_get(r, 'fwd_vs_matmul'), '.2f'):>6}"
                f"{_e(_get(r, 'grad_e_rel_err')):>8}{_e(_get(r, 'grad_c_rel_err')):>8}"
                + ("" if st == "ok" else f" [{st} at {r.get('stage')}]")
            )
    sweep = [cs for cs in data["cases"] if cs["kind"] == "sweep"]
    if sweep:
        methods = [
            k
            for k, _ in _method_order(sweep)
            if any(cs["methods"].get(k, {}).get("status") != "unavailable" for cs in sweep)
        ]
        short = [k.replace("ours:", "").replace("cce_kahan", "kahan") for k in methods]
        w = max([8] + [len(k) + 1 for k in short])
        lines.append(f"-- sweep {sweep[0]['shape']}: fwd+bwd ms per N (memory in the .md)")
        lines.append("   " + f"{'regime':<7}{'N':>6}" + "".join(f"{k:>{w}}" for k in short))
        for cs in sorted(sweep, key=lambda x: (x["regime"], x["N"])):
            cells = []
            for k in methods:
                r = cs["methods"].get(k, {})
                ms = _get(r, "fwd_bwd", "median_ms")
                cells.append(str(r.get("status", "-")) if ms is None else f"{ms:.1f}")
            lines.append("   " + f"{cs['regime']:<7}{cs['N']:>6}" + "".join(f"{c:>{w}}" for c in cells))
    if data.get("skipped_cases"):
        lines.append(f"!! time budget: {len(data['skipped_cases'])} cases not run")
    if data.get("aborted"):
        lines.append(f"!! run aborted: {data['aborted']}")
    return "\n".join(lines)


def render_png(data: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable ({C.short_error(exc, 80)}): no PNG written"

    main = [cs for cs in data["cases"] if cs["kind"] == "main"]
    sweep = [cs for cs in data["cases"] if cs["kind"] == "sweep"]
    main_regimes = list(dict.fromkeys(cs["regime"] for cs in main))
    sweep_regimes = list(dict.fromkeys(cs["regime"] for cs in sweep))
    nrows = len(main_regimes) + (1 if sweep else 0)
    if nrows == 0:
        return "nothing to plot"
    fig, axes = plt.subplots(nrows, 2, figsize=(16, 4.6 * nrows), squeeze=False)
    all_methods = _method_order(data["cases"])
    colors = {k: plt.cm.tab10(i % 10) for i, (k, _) in enumerate(all_methods)}
    labels = dict(all_methods)

    for row, regime in enumerate(main_regimes):
        cases = [cs for cs in main if cs["regime"] == regime]
        methods = [
            k
            for k, _ in _method_order(cases)
            if any(_get(cs["methods"].get(k, {}), "fwd_bwd", "median_ms") for cs in cases)
        ]
        width = 0.8 / max(1, len(methods))
        for col, (metric, ylabel, scale) in enumerate(
            [
                (("fwd_bwd", "median_ms"), "fwd+bwd ms", 1.0),
                (("fwd_bwd_mem_bytes",), "fwd+bwd peak MiB", C.MiB),
            ]
        ):
            ax = axes[row][col]
            for j, k in enumerate(methods):
                xs, ys = [], []
                for i, cs in enumerate(cases):
                    v = _get(cs["methods"].get(k, {}), *metric)
                    if v is not None:
                        xs.append(i + (j - (len(methods) - 1) / 2) * width)
                        ys.append(v / scale)
                ax.bar(xs, ys, width=width, color=colors[k])
            if col == 1:
                lb = [cs["lower_bound_bytes"] / C.MiB for cs in cases]
                ax.scatter(range(len(cases)), lb, marker="_", s=400, color="black", zorder=5)
            else:
                mm = [_get(cs, "matmul", "ms") for cs in cases]
                pts = [(i, 3 * v) for i, v in enumerate(mm) if v]
                if pts:
                    ax.scatter(
                        [p[0] for p in pts], [p[1] for p in pts], marker="_", s=400, color="black", zorder=5
                    )
            ax.set_yscale("log")
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels([f"{cs['shape']}\nV={cs['V']} D={cs['D']}" for cs in cases], fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{regime}, N={cases[0]['N']}: {ylabel}")
            ax.grid(axis="y", alpha=0.3)

    if sweep:
        row = nrows - 1
        styles = ["-", "--", ":", "-."]
        for col, (metric, ylabel, scale) in enumerate(
            [
                (("fwd_bwd", "median_ms"), "fwd+bwd ms", 1.0),
                (("fwd_bwd_mem_bytes",), "fwd+bwd peak MiB", C.MiB),
            ]
        ):
            ax = axes[row][col]
            # Memory hardly depends on the regime: plot the first one only, to keep the panel readable.
            regimes_here = sweep_regimes if col == 0 else sweep_regimes[:1]
            for ri, regime in enumerate(regimes_here):
                cases = sorted([cs for cs in sweep if cs["regime"] == regime], key=lambda x: x["N"])
                for k, _ in _method_order(cases):
                    pts = [(cs["N"], _get(cs["methods"].get(k, {}), *metric)) for cs in cases]
                    pts = [(n, v / scale) for n, v in pts if v is not None]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            styles[ri % 4],
                            marker="o",
                            ms=3,
                            color=colors[k],
                        )
            cases = sorted([cs for cs in sweep if cs["regime"] == sweep_regimes[0]], key=lambda x: x["N"])
            if col == 1:
                ax.plot(
                    [cs["N"] for cs in cases],
                    [cs["lower_bound_bytes"] / C.MiB for cs in cases],
                    "k_",
                    ms=14,
                    mew=2,
                )
            else:
                pts = [(cs["N"], _get(cs, "matmul", "ms")) for cs in cases]
                pts = [(n, 3 * v) for n, v in pts if v]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "k_", ms=14, mew=2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens N")
            ax.set_ylabel(ylabel)
            shown = ", ".join(f"{r} {styles[i % 4]}" for i, r in enumerate(regimes_here))
            ax.set_title(f"token sweep, {sweep[0]['shape']}: {ylabel} ({shown})")
            ax.grid(alpha=0.3)

    # One legend for the whole figure: a colour per method, then the black markers.
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=colors[k], label=labels[k])
        for k, _ in all_methods
        if any(cs["methods"].get(k, {}).get("status") != "unavailable" for cs in data["cases"])
    ]
    handles.append(
        Line2D(
            [],
            [],
            color="black",
            marker="_",
            ls="none",
            ms=14,
            mew=2,
            label="time panels: 3 × cuBLAS logits matmul; memory panels: lower bound ∇E+∇C",
        )
    )
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    meta = data["meta"]
    fig.suptitle(
        f"{meta['device']} · torch {meta['torch']} · triton {meta['triton']} · "
        + (f"merged from {len(meta['sources'])} runs" if meta.get("sources") else meta["git_commit"][:12])
        + f" · {meta['date'][:10]}",
        fontsize=10,
    )
    legend_in = 0.25 * math.ceil(len(handles) / 4) + 0.2  # legend height in inches
    fig.tight_layout(rect=(0, legend_in / (4.6 * nrows), 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(data: dict, stem: Path, *, png: bool) -> list[str]:
    written = []
    C.write_json(stem.with_suffix(".json"), data)
    written.append(str(stem.with_suffix(".json")))
    stem.with_suffix(".md").write_text(render_markdown(data))
    written.append(str(stem.with_suffix(".md")))
    if png:
        msg = render_png(data, stem.with_suffix(".png"))
        if msg:
            print(f"[bench_loss] {msg}", flush=True)
        else:
            written.append(str(stem.with_suffix(".png")))
    return written


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            "Examples: a short device run: --shapes gemma2-2b,llama3-8b --sweep none --time-budget 480 "
            "--out $OUT; only our impls on one shape: --methods eager,ours --shapes phi3.5-mini; "
            "the sweep alone: --shapes none --sweep 1024,8192,65536; re-render merged results: "
            "--render a.json b.json --tag merged."
        ),
    )
    p.add_argument(
        "--shapes",
        default=",".join(C.MODEL_SHAPES),
        help="comma list of model shapes (or NxVxD), 'none' for no model shapes",
    )
    p.add_argument("--tokens", type=int, default=C.DEFAULT_TOKENS, help="tokens N for the model shapes")
    p.add_argument("--sweep", default=DEFAULT_SWEEP, help="token counts of the sweep, 'none' to skip it")
    p.add_argument("--sweep-shape", default="gemma2-2b", help="model shape of the token sweep")
    p.add_argument("--regimes", default="trained,random", help=f"comma list from {', '.join(C.REGIMES)}")
    p.add_argument("--sweep-regimes", default=None, help="regimes of the sweep (default: --regimes)")
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma list: eager, compile, liger, cutce, torch_lce, ours (every Triton impl), ours:<impl>; "
        "base[:<impl>...] as ours, for the --baseline package",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="REF_OR_DIR",
        help="the cce_parallel that base[:...] methods run: a folder written by `python -m benchmarks "
        "baseline REF DIR`, or a git ref of this checkout",
    )
    p.add_argument(
        "--include-torch-impl",
        action="store_true",
        help="with 'ours', also run cce_parallel's chunked pure-PyTorch impl 'torch'",
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed calls before timing (after one untimed accuracy call)"
    )
    p.add_argument("--repeats", type=int, default=10, help="timed calls; the median is reported")
    p.add_argument(
        "--rounds", type=int, default=5,
        help="forward + backward is timed in this many rounds over all methods, --repeats calls per method in all",
    )
    p.add_argument("--no-errors", action="store_true", help="skip the fp32 reference and the error columns")
    p.add_argument("--stats-rows", type=int, default=1024, help="rows sampled for the softmax statistics")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; start no new method after this, write what was measured",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default benchmarks/results, or a temp folder with --cpu-smoke)",
    )
    p.add_argument("--tag", default=None, help="suffix of the output names: <gpu>_<yyyymmdd>_<tag>")
    p.add_argument("--commit", default=None, help="commit to record (where the tree has no .git)")
    p.add_argument("--no-png", action="store_true", help="skip the plot")
    p.add_argument(
        "--cpu-smoke",
        "--dry-run",
        dest="cpu_smoke",
        action="store_true",
        help="tiny shapes on the CPU with torch eager, F.linear_cross_entropy and cce_parallel's "
        "'torch' impl: tests the plumbing, measures nothing meaningful",
    )
    p.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        default=None,
        help="no measuring: merge these result files and write .md/.png (and a merged .json)",
    )
    return p.parse_args(argv)


def render_only(args) -> int:
    datas = [json.loads(Path(f).read_text()) for f in args.render]
    merged: dict = {"meta": dict(datas[0]["meta"]), "cases": []}
    merged["meta"]["sources"] = [
        f"{Path(f).name} (commit {d['meta'].get('git_commit')}, {d['meta'].get('date')})" for f, d in zip(args.render, datas)
    ]
    for d in datas:
        if d.get("square_matmul"):
            merged["square_matmul"] = d["square_matmul"]
        for k in ("repeats", "warmup", "rounds"):
            merged["meta"].setdefault(k, d["meta"].get(k))
    index: dict = {}
    for d in datas:  # later files win for the same (kind, shape, N, regime)
        for cs in d["cases"]:
            index[(cs["kind"], cs["shape"], cs["N"], cs["regime"])] = cs
    merged["cases"] = list(index.values())
    out_dir = Path(args.out) if args.out else Path(args.render[0]).parent
    stem = C.out_stem(out_dir, merged["meta"], args.tag or "merged")
    written = write_outputs(merged, stem, png=not args.no_png)
    print(render_compact(merged))
    print("[bench_loss] wrote " + ", ".join(written))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render_only(args)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.cpu_smoke:
        device = "cpu"
        table = C.SMOKE_SHAPES
        if args.shapes == ",".join(C.MODEL_SHAPES):
            args.shapes = ",".join(C.SMOKE_SHAPES)
        if args.sweep == DEFAULT_SWEEP:
            args.sweep = SMOKE_SWEEP
        if args.sweep_shape == "gemma2-2b":
            args.sweep_shape = "tiny-a"
        if args.tokens == C.DEFAULT_TOKENS:
            args.tokens = 64
        if args.methods == DEFAULT_METHODS:
            args.methods = "eager,torch_lce,ours:torch"
        if args.warmup == 2:
            args.warmup = 1
        if args.repeats == 10:
            args.repeats = 3
        out_dir = Path(args.out) if args.out else Path("/tmp/cce_parallel_bench_smoke")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or use --cpu-smoke to test the plumbing")
        device = "cuda"
        table = C.MODEL_SHAPES
        out_dir = Path(args.out) if args.out else C.REPO_ROOT / "benchmarks" / "results"
        torch.backends.cuda.matmul.allow_tf32 = False
    args.rounds = max(1, min(args.rounds, args.repeats))

    shapes_arg = C.csv_list(args.shapes)
    shapes = [] if shapes_arg == ["none"] else [C.parse_shape(s, args.tokens, table) for s in shapes_arg]
    regimes = C.csv_list(args.regimes)
    sweep_regimes = C.csv_list(args.sweep_regimes) if args.sweep_regimes else regimes
    for r in regimes + sweep_regimes:
        if r not in C.REGIMES:
            raise SystemExit(f"unknown regime {r!r}; known: {', '.join(C.REGIMES)}")
    sweep_tokens = [] if args.sweep.strip() == "none" else [int(x) for x in C.csv_list(args.sweep)]
    sweep_base = C.parse_shape(args.sweep_shape, args.tokens, table) if sweep_tokens else None

    cases = [Case("main", s, r) for s in shapes for r in regimes]
    # Shape-major order: a second regime of the same shape reuses compiled / autotuned kernels.
    cases += [Case("sweep", sweep_base.with_tokens(n), r) for n in sweep_tokens for r in sweep_regimes]

    baseline = C.import_baseline(args.baseline) if args.baseline else None
    methods = build_methods(C.csv_list(args.methods), args.include_torch_impl, baseline)
    meta = C.run_metadata(device, args.commit)
    meta.update(
        {
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "flop_convention": FLOP_CONVENTION,
            "memory_convention": MEMORY_CONVENTION,
            "regimes": {r: C.REGIMES[r] for r in dict.fromkeys(regimes + sweep_regimes)},
            "methods": {m.key: {"label": m.label, "unavailable": m.unavailable, **m.info} for m in methods},
            "packages": {
                n: C.pkg_version(n)
                for n in ("liger-kernel", "cut-cross-entropy", "cce-parallel", "megatron-core", "numpy")
            },
        }
    )
    data: dict = {"meta": meta, "cases": []}
    stem = C.out_stem(out_dir, meta, args.tag)

    print(
        f"[bench_loss] {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
        f"commit {meta['git_commit']}",
        flush=True,
    )
    for m in methods:
        print(
            f"[bench_loss] method {m.key:<22} {m.label}"
            + (f"  UNAVAILABLE: {m.unavailable}" if m.unavailable else ""),
            flush=True,
        )
    print(f"[bench_loss] {len(cases)} cases x {len(methods)} methods -> {stem}.{{json,md,png}}", flush=True)

    start = time.monotonic()
    deadline = start + args.time_budget if args.time_budget else None
    if C.is_cuda(device):
        n = 8192
        data["square_matmul"] = {
            "n": n,
            **C.matmul_ms(C.Shape("square", n, n, n), device=device, dtype=dtype),
        }
    rc = 0
    try:
        for i, case in enumerate(cases):
            if deadline is not None and time.monotonic() > deadline:
                data.setdefault("skipped_cases", []).append(
                    {"kind": case.kind, "shape": case.shape.name, "N": case.shape.N, "regime": case.regime}
                )
                continue
            print(
                f"[{time.monotonic() - start:6.0f}s] case {i + 1}/{len(cases)}: {case.kind} "
                f"{case.shape.label} {case.regime}",
                flush=True,
            )
            run_case(case, methods, args, device, dtype, args.seed + i, deadline, data["cases"])
            data["elapsed_s"] = time.monotonic() - start
            write_outputs(data, stem, png=False)  # partial results survive a killed run
    except FatalCudaError as exc:
        data["aborted"] = f"fatal CUDA error, run stopped: {exc}"
        print(f"[bench_loss] {data['aborted']}", flush=True)
        rc = 3
    except Exception as exc:  # noqa: BLE001 - a bug here must not lose what was measured
        import traceback

        traceback.print_exc()
        data["aborted"] = f"unexpected error, run stopped: {C.short_error(exc)}"
        rc = 4
    data["elapsed_s"] = time.monotonic() - start
    if data.get("skipped_cases"):
        print(f"[bench_loss] time budget: skipped {len(data['skipped_cases'])} cases", flush=True)
    written = write_outputs(data, stem, png=not args.no_png)
    print(render_compact(data))
    print(f"[bench_loss] {data['elapsed_s']:.0f} s; wrote " + ", ".join(written), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
