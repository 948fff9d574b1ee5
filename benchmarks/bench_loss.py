"""How fast, how lean and how accurate is the loss + gradient on one GPU, next to the peers?

Per (shape, regime) and method: forward + backward time in rounds that run every method in turn,
peak memory above the inputs, TFLOP/s, and loss / ∇E / ∇C error against an fp32 reference
(docs/performance.md and benchmarks/README.md give the method). Results:
<out>/<gpu>_<yyyymmdd>[_<tag>].{json,md}, the JSON rewritten after every case.

    python -m benchmarks loss [--shapes gemma2-2b,...] [--regimes trained,random] [--methods eager,ours,...]
    python -m benchmarks loss --cpu-smoke        # tiny shapes on the CPU: the plumbing

Post-training objectives (_objectives.py), each for ours and the peers (--post-methods: ours[:<impl>], verl,
liger, compile, eager), in the same rounds as ours' plain mean (ours:<impl>, added to the mean's methods,
or alone without `mean`), at --temperature T:

    python -m benchmarks loss --objectives rl,logprobs,score [--temperature 1.0] [--post-methods ours,verl,...]

rl: -(logp · adv).mean() - 0.01 · entropy.mean(), forward + backward; logprobs: -(logp · adv).mean(), the
same; score: per-token logp and entropy under torch.no_grad(), forward only, against ours' plain-mean forward
alone (the row fwd:ours). `mean` (the default) is the rows above, unchanged.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _common as C
import _objectives as O
import torch
import torch.nn.functional as F

DEFAULT_METHODS = "eager,compile,liger,cutce,ours"
FLOP_CONVENTION = "forward+backward: 6·N·V·D FLOPs (logits, ∇E, ∇C), no credit for recomputing the logits"
MEMORY_CONVENTION = (
    "peak torch.cuda.max_memory_allocated above memory_allocated just before the call, "
    "in MiB (2^20 B); the lower bound is the bytes of ∇E + ∇C; ours' from a call after the timed ones (the path "
    "its module settled on), the others' from the call after the accuracy call"
)
POST_MEMORY = (
    "post-training rows: the same, of one call (rl, logprobs: forward + backward; score, fwd: the forward alone), "
    "ours' from a call after the timed ones, the others' from the call after the accuracy call")
# The calling patterns of `ours:<impl>/<pattern>`: how a training loop turns our loss into the scalar it
# differentiates. r: random per-token weights in [0, 1); mask: 0 on the 10 % of the tokens where r < 0.1, 1
# elsewhere (_draws). The first four give the per-token weights only in the backward (reduction="none"), the
# fwd_ ones give them to the forward (weights=, reduction="mean"). fwd_weighted and weighted weigh by the same
# r but normalize differently: Σ r·loss / Σ r against Σ r·loss / N.
UPSTREAMS = {
    "masked": "per-token loss x loss_mask / count, the mask folded into ignore_index (Megatron's way, 10 % masked)",
    "folded": "per-token loss summed / count, the mask folded into ignore_index (the train job's way, 10 % masked)",
    "unfolded": "per-token loss x loss_mask / count, the mask not folded into ignore_index (10 % masked)",
    "weighted": "per-token loss x random per-token weights r / N (the weights only in the backward)",
    "fwd_weighted": "weights=r in the forward (weighted's r), reduction mean: Σ r·loss / Σ r",
    "fwd_masked": "weights=loss_mask in the forward (unfolded's mask, 0 / 1), reduction mean: Σ mask·loss / count",
}
IN_FORWARD = ("fwd_weighted", "fwd_masked")  # reduction "mean" with weights=; the others reduction "none"
CALLS = {  # each pattern as a training loop writes it, `loss` its LinearCrossEntropy (docs/api.md's table)
    "": "loss(e, c, t)",
    "fwd_weighted": "loss(e, c, t, weights=r)",
    "fwd_masked": "loss(e, c, t, weights=mask)",
    "masked": "(loss(e, c, mask_labels(t, mask)) * mask).sum() / mask.sum()",
    "folded": "loss(e, c, mask_labels(t, mask)).sum() / mask.sum()",
    "unfolded": "(loss(e, c, t) * mask).sum() / mask.sum()",
    "weighted": "(loss(e, c, t) * r).sum() / N",
}


# ---- Methods -------------------------------------------------------------------------------------


def eager_loss(e: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(e, c).float(), t, reduction="mean")


@dataclass
class Method:
    key: str  # short, used on the command line and in the printed table
    label: str  # long, used in the Markdown table
    make: Callable[[], Callable] | None = None  # builds loss_fn(e, c, t) for one case
    unavailable: str | None = None
    info: dict = field(default_factory=dict)


def _make_compile():
    import torch._dynamo

    torch._dynamo.reset()  # a fresh compile per case, static shapes
    return torch.compile(eager_loss, dynamic=False)


def _draws(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, mask) of the calling patterns for targets t: fp32 weights uniform in [0, 1) (seed 1), and the
    0 / 1 float mask that drops the tokens where r < 0.1."""
    g = torch.Generator(t.device).manual_seed(1)
    r = torch.rand(t.shape, device=t.device, generator=g)
    return r, (r >= 0.1).float()


def coefficients(upstream: str, t: torch.Tensor) -> torch.Tensor:
    """a (fp32, shaped like t) such that the pattern's loss is Σ a_i · loss_i, loss_i the token's
    cross-entropy: what its fp32 reference is computed for (C.reference_loss_grads)."""
    r, mask = _draws(t)
    if upstream == "weighted":
        return r / t.numel()
    if upstream == "fwd_weighted":
        return r / r.sum()
    return mask / mask.sum()  # the masks, in the forward or the backward, folded or not


def _pattern(loss_fn, upstream: str):
    """The scalar loss(e, c, t) of a calling pattern, loss_fn the LinearCrossEntropy it calls."""
    cache: dict = {}

    def loss(e, c, t):
        if t not in cache:  # fixed per input set, made outside the timed region after the first call
            cache.clear()
            cache[t] = _draws(t)
        r, mask = cache[t]
        if upstream == "fwd_weighted":
            return loss_fn(e, c, t, weights=r)
        if upstream == "fwd_masked":
            return loss_fn(e, c, t, weights=mask)
        if upstream == "unfolded":
            return (loss_fn(e, c, t) * mask).sum() / mask.sum()
        if upstream in ("masked", "folded"):
            # cce_parallel.megatron.mask_labels (inlined: megatron-core need not be installed here)
            per_token = loss_fn(e, c, t.masked_fill(mask == 0, -100))
            # folded: masked tokens' losses are 0, so the plain sum is the masked one (train.trainer.loss_func)
            return (per_token.sum() if upstream == "folded" else (per_token * mask).sum()) / mask.sum()
        return (loss_fn(e, c, t) * r).sum() / t.numel()

    return loss


def _peer(key: str, label: str, module: str, dist: str, make) -> Method:
    try:
        fn = make(importlib.import_module(module))
    except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
        return Method(key, label, unavailable=C.short_error(exc))
    ver = C.pkg_version(dist)
    return Method(key, label.replace(" ", f" {ver} ", 1), fn, info={"version": ver})


def _liger(mod):
    def make():
        loss = mod.LigerFusedLinearCrossEntropyLoss(reduction="mean")
        return lambda e, c, t: loss(c, e, t)  # liger takes (weight, input, target)

    return make


def _cutce(mod):
    return lambda: lambda e, c, t: mod.linear_cross_entropy(e, c, t, impl="cce", reduction="mean")


def _ours(key: str, out: list) -> None:
    """`ours[:<impl>][@<budget>][/<upstream>]` into `out`."""
    spec, _, upstream = key.partition("/")
    if upstream not in ("", *UPSTREAMS):
        raise SystemExit(f"unknown upstream {upstream!r} in {key!r}: {', '.join(UPSTREAMS)}")
    try:
        import cce_parallel as pkg
    except Exception as exc:  # noqa: BLE001
        out.append(Method(key, "cce_parallel", unavailable=C.short_error(exc)))
        return
    package, impls = pkg.__name__, list(getattr(pkg, "IMPLS", ()))
    # What a loss learns from its backwards lives in the LinearCrossEntropy that owns it; a package from
    # before that kept it in module globals, which methods taking turns would share.
    stateless = None if hasattr(pkg, "UpstreamState") else f"{package} has no UpstreamState (a loss module's own)"
    for mkey, impl, text, budget in C.expand_ours(spec, impls):
        mkey += f"/{upstream}" if upstream else ""
        if any(m.key == mkey for m in out):
            continue
        if stateless or impl not in impls:
            out.append(Method(mkey, f"{package} {impl}", unavailable=stateless or f"not in IMPLS {impls}"))
            continue

        def make(impl=impl, budget=budget):
            # A loss module of its own per method and case, as a training loop holds one: what its
            # backwards teach it (another path after /weighted or /unfolded) stays there, and methods
            # taking turns in the rounds never see each other's.
            module = pkg.LinearCrossEntropy(impl=impl, logits_budget=budget,
                                            reduction="none" if upstream and upstream not in IN_FORWARD else "mean")
            if not upstream:
                return module
            loss = _pattern(module, upstream)
            loss.state = module.state  # as the module's: its paths go into the result (run_case)
            return loss

        label = f"{package} {impl}" + (f" @{text}" if text else "") + (f", {UPSTREAMS[upstream]}" if upstream else "")
        out.append(Method(mkey, label, make, info={"impl": impl, "logits_budget": budget, "upstream": upstream or None}))


def build_methods(keys: list[str]) -> list[Method]:
    out: list[Method] = []
    for key in keys:
        if key == "eager":
            out.append(Method("eager", "torch eager", lambda: eager_loss))
        elif key == "compile":
            out.append(Method("compile", "torch.compile", _make_compile))
        elif key == "liger":
            out.append(_peer("liger", "liger-kernel FLCE", "liger_kernel.transformers", "liger-kernel", _liger))
        elif key == "cutce":
            out.append(_peer("cutce", "cut-cross-entropy (cce)", "cut_cross_entropy", "cut-cross-entropy", _cutce))
        elif key.partition("/")[0].partition(":")[0] == "ours":
            _ours(key, out)
        else:
            raise SystemExit(f"unknown method {key!r}; known: eager, compile, liger, cutce, ours, ours:<impl>")
    return out


# ---- Measuring -----------------------------------------------------------------------------------


def run_case(shape: C.Shape, regime: str, methods, args, device, dtype, seed: int, sink: list,
             post: O.PostRun | None = None) -> None:
    """Measure one case; its dict goes into ``sink`` first, so a fatal error keeps what was measured. With
    post, its post-training rows too (out["post"]), timed in the same rounds as the methods."""
    N, V, D = shape.N, shape.V, shape.D
    bound = (N * D + V * D) * (torch.finfo(dtype).bits // 8)
    out = {"kind": "main", "shape": shape.name, "N": N, "V": V, "D": D, "regime": regime,
           "dtype": str(dtype).replace("torch.", ""), "seed": seed, "lower_bound_bytes": bound,
           "input_bytes": bound + N * 8, "methods": {}}
    sink.append(out)
    t0 = time.perf_counter()
    if post is not None:  # the objectives' torch.compile graphs: fresh per case
        import torch._dynamo as dynamo

        dynamo.reset()
    C.free_memory(device)
    e = ref = None
    stage = "inputs"
    try:
        e, c, t = C.make_inputs(shape, regime, dtype=dtype, device=device, seed=seed)
        stage = "softmax stats"
        out["softmax"] = C.softmax_stats(e, c, t, rows=1024)
        stage = "fp32 reference"
        ref = C.reference_loss_grads(e, c, t)
        out["ref_loss"] = ref[0]
        C.free_memory(device)
        stage = "cuBLAS matmul"
        out["matmul"] = C.matmul_ms(shape, device=device, dtype=dtype, warmup=args.warmup, repeats=args.repeats)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM of the reference at a large N: say so, go on
        out.setdefault("setup_errors", {})[stage] = C.short_error(exc)
        print(f"  setup {stage}: {C.short_error(exc, 160)}", flush=True)
        if C.is_fatal_cuda_error(exc):
            raise C.FatalCudaError(str(exc)) from None
        if e is None:  # no inputs: nothing can be measured
            out["status"] = "oom" if C.is_oom(exc) else "error"
            return
    C.free_memory(device)
    out["setup_s"] = time.perf_counter() - t0

    e.requires_grad_(True)
    c.requires_grad_(True)
    alive = []
    for m in methods:
        t1 = time.perf_counter()
        res = out["methods"][m.key] = {"key": m.key, "label": m.label, "status": "ok"}
        if m.unavailable:
            res.update(status="unavailable", error=m.unavailable, wall_s=time.perf_counter() - t1)
            continue
        mref, upstream = ref, m.info.get("upstream")
        if upstream and ref is not None:  # a calling pattern's loss is not the plain mean: its own reference
            mref = _pattern_reference(upstream, e, c, t, out)
            res["ref_loss"] = mref and mref[0]
        try:
            mine, fn = C.measure(m.make, e, c, t, device=device, ref=mref, mem_key="fwd_bwd_mem_bytes")
        except C.FatalCudaError as exc:
            res.update(exc.result)
            raise
        finally:
            del mref
        res.update(mine, wall_s=time.perf_counter() - t1)
        if fn is not None:
            alive.append((res, fn))
    rows = _measure_post(post, out, e, c, t, device) if post is not None else []
    extra = [(res, O.timing(res["objective"]), functools.partial(O.run, call, res["objective"], e, c, t))
             for res, call in rows]
    t1 = time.perf_counter()
    try:  # against torch.compile round by round
        C.time_fwd_bwd(alive, e, c, t, args, device=device, flops=6.0 * N * V * D, tflops_key="fwd_bwd_tflops",
                       paired_to="compile", extra=extra)
        _settled_peaks([(res, fn, "fwd_bwd", functools.partial(_fwd_bwd, fn, e, c, t)) for res, fn in alive]
                       + [(res, call, what, unit) for (res, call), (_, what, unit) in zip(rows, extra)], e, c, device)
    finally:
        for res, fn in alive + rows:
            res["wall_s"] += (time.perf_counter() - t1) / len(alive + rows)
            paths = _paths(fn)
            if paths is not None:
                res["paths"] = paths
        if rows:
            O.ratios(out["post"]["rows"], out["methods"].get(post.mean_key),
                     C.round_sizes(args.repeats, args.rounds))
        del alive, rows, extra
    del e, c, t, ref
    C.free_memory(device)


def _measure_post(post: O.PostRun, out: dict, e, c, t, device) -> list:
    """The post-training rows of one case into out["post"]["rows"] (O.measure: errors against each objective's
    reference, peak memory), one objective's reference alive at a time; the (res, call) of those that ran."""
    T = post.temperature
    block = out["post"] = {"objectives": post.objectives, "temperature": T, "entropy_coef": O.ENTROPY_COEF,
                           "adv_seed": O.ADV_SEED, "mean_key": post.mean_key, "ref": {}, "rows": {}}
    alive, refs = [], {}
    for objective, method in post.rows():
        if objective not in refs:
            refs.clear()
            C.free_memory(device)
            refs[objective] = _post_reference(objective, e, c, t, T, out)
        t1 = time.perf_counter()
        try:
            res, call = O.measure(method, objective, e, c, t, temperature=T, ref=refs[objective], device=device)
        except C.FatalCudaError as exc:
            block["rows"][O.row_key(objective, method.key)] = exc.result
            raise
        block["rows"][res["key"]] = res
        res["wall_s"] = time.perf_counter() - t1
        if call is not None:
            alive.append((res, call))
    refs.clear()
    C.free_memory(device)
    return alive


def _post_reference(objective: str, e, c, t, temperature: float, out: dict) -> dict | None:
    """An objective's reference (O.reference: logp, entropy, and for rl and logprobs the objective and its
    gradients), its summary in out["post"]["ref"]; fwd's is the plain mean's loss. None where it failed (in
    out's setup_errors)."""
    if objective == O.FWD:
        return {"loss": out.get("ref_loss")}
    try:
        a, b = O.weights(objective, t) if objective in O.BACKWARD else (None, None)
        ref = O.reference(e, c, t, temperature=temperature, a=a, b=b)
    except Exception as exc:  # noqa: BLE001 - as the plain reference: say so, measure without it
        out.setdefault("setup_errors", {})[f"fp32 reference {objective}"] = C.short_error(exc)
        if C.is_fatal_cuda_error(exc):
            raise C.FatalCudaError(str(exc)) from None
        return None
    out["post"]["ref"][objective] = {"loss": ref.get("loss"), "logp_mean": float(ref["logp"].mean()),
                                     "entropy_mean": float(ref["entropy"].mean())}
    return ref


def _pattern_reference(upstream: str, e, c, t, out: dict):
    """The fp32 (loss, ∇E, ∇C) of a calling pattern's loss (coefficients), or None (in out's setup_errors)."""
    try:
        return C.reference_loss_grads(e, c, t, coef=coefficients(upstream, t))
    except Exception as exc:  # noqa: BLE001 - as the plain reference: say so, measure without it
        out.setdefault("setup_errors", {})[f"fp32 reference /{upstream}"] = C.short_error(exc)
        if C.is_fatal_cuda_error(exc):
            raise C.FatalCudaError(str(exc)) from None
        return None
    finally:
        C.free_memory(e.device)


def _settled_peaks(entries: list, e, c, device) -> None:
    """Our methods' peak memory (res[f"{what}_mem_bytes"] of each (res, fn, what, unit), unit() one timed call) again,
    from a call after the timed ones: measure() took it at the second call, before the module had read what
    the first backward taught it (a GPU's report arrives a call late), so a pattern whose first backward
    moves it to another path (/weighted, /unfolded) would show the first path's peak."""
    for res, fn, what, unit in entries:
        if getattr(fn, "state", None) is None or res.get("status") != "ok":
            continue
        try:
            res[f"{what}_mem_bytes"] = C.peak_bytes(unit, device=device)
        except Exception as exc:  # noqa: BLE001 - recorded as measure() records its failures
            res.update(C.failure(exc, f"{what.replace('_', '+')} memory after the timed calls"))
            if C.is_fatal_cuda_error(exc):
                raise C.FatalCudaError(res["error"]) from None
        finally:
            C.clear_grad(e, c)
            C.free_memory(device)


def _fwd_bwd(fn, e, c, t):
    loss = fn(e, c, t)
    loss.backward()
    return loss


def _paths(fn) -> dict | None:
    """The paths a method's LinearCrossEntropy took over every call of the case (accuracy, memory, warm-up
    and timed calls: UpstreamState.paths), its last backward's report read; None for the peers."""
    state = getattr(fn, "state", None)
    if state is None:
        return None
    try:
        state.read_reports()
    except Exception:  # noqa: BLE001 - a broken CUDA context must not hide the error that broke it
        pass
    return dict(sorted(state.paths.items()))


# ---- Reports: Markdown, from the JSON alone ------------------------------------------------------


def over_base_paired(cs: dict, meta: dict) -> list[tuple[str, str, float]]:
    """(method, its base method, ratio) for every upstream variant (`.../masked`) whose base (the
    plain mean) ran in the same rounds: C.paired_ratio of their stored fwd+bwd call times."""
    sizes = C.round_sizes(meta.get("repeats") or 0, meta.get("rounds") or 1)
    out = []
    for key, r in cs["methods"].items():
        base = key.rsplit("/", 1)[0]
        if "/" not in key or base not in cs["methods"]:
            continue
        times, ref = ((x.get("fwd_bwd") or {}).get("times_ms") for x in (r, cs["methods"][base]))
        ratio = C.paired_ratio(times, ref, sizes) if times and ref else None
        if ratio is not None:
            out.append((key, base, ratio))
    return out


def render_markdown(data: dict) -> str:
    meta, get = data["meta"], C.get
    lines = ["# Loss + gradient on one GPU: cce_parallel next to its peers", "",
             (f"- device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
              f"CUDA {meta.get('cuda')}, Python {meta.get('python')}"),
             f"- commit: `{meta['git_commit']}`; date: {meta['date']}", f"- command: `{meta['command']}`"]
    sq = data.get("square_matmul")
    if sq and "tflops" in sq:
        lines.append(f"- cuBLAS bf16 {sq['n']}³ matmul: {sq['tflops']:.0f} TFLOP/s")
    lines += [
        (f"- timing: median of {meta.get('repeats')} after {meta.get('warmup')} warm-up calls (and one accuracy "
         "call), CUDA events (perf_counter on a CPU), fresh gradients each call, reduction 'mean'; forward + "
         f"backward in {meta.get('rounds', 1)} rounds over all methods, one warm-up call per method in each later round"),
        f"- FLOPs: {FLOP_CONVENTION}", f"- memory: {MEMORY_CONVENTION}",
        ("- errors: ‖x − ref‖_F / ‖ref‖_F against an fp32 reference from the same inputs upcast; for a calling "
         "pattern (`ours:X/<pattern>`), the reference of its own loss (Σ a_i·loss_i, a_i its per-token factors)"),
        ("- fwd+bwd ×compile, paired: per round, the method's median fwd+bwd time over torch.compile's in "
         "that round; the median of those ratios over the rounds (a clock drifting between rounds cancels)"),
        "", "Regimes:"]
    lines += [*(f"- **{r}**: {C.REGIMES.get(r, '?')}" for r in sorted({cs["regime"] for cs in data["cases"]})), ""]
    unavailable = {k: r.get("error", "") for cs in data["cases"] for k, r in cs["methods"].items()
                   if r.get("status") == "unavailable"}
    if unavailable:
        lines += ["Unavailable: " + "; ".join(f"`{k}` ({v})" for k, v in unavailable.items()), ""]
    if data["cases"]:
        lines += ["## Model shapes", ""]
    for cs in data["cases"]:
        sm, mm = cs.get("softmax", {}), cs.get("matmul", {})
        head = [f"lower bound {C.fmt_mib(cs['lower_bound_bytes'])} MiB",
                (f"softmax entries ≥ 2^-12: {100 * (get(sm, 'frac_ge_eps') or 0):.4f} % "
                 f"({C.fmt_num(get(sm, 'entries_ge_eps_per_row'), '.1f')} per row)"),
                f"median p(target) {C.fmt_num(get(sm, 'p_target_median'), '.3f')}",
                f"fp32 loss {C.fmt_num(get(cs, 'ref_loss'), '.4f')}"]
        if "ms" in mm:
            head.append(f"cuBLAS logits matmul {mm['ms']:.2f} ms ({mm['tflops']:.0f} TFLOP/s)")
        rows = []
        for k, r in cs["methods"].items():
            status = r.get("status", "?")
            if status == "unavailable":
                continue
            if status != "ok":
                status = f"{status}{' (' + r['stage'] + ')' if r.get('stage') else ''}: {r.get('error', '')[:100]}"
            rows.append([r.get("label", k), C.fmt_num(get(r, "fwd_bwd", "median_ms"), ".2f"),
                         C.fmt_num(get(r, "fwd_bwd", "vs_compile_paired"), ".3f"),
                         C.fmt_mib(get(r, "fwd_bwd_mem_bytes")), C.fmt_num(get(r, "fwd_bwd_tflops"), ".0f"),
                         *(C.fmt_num(get(r, f"{x}_rel_err"), ".1e") for x in ("loss", "grad_e", "grad_c")), status])
        lines += [f"### {cs['shape']} (N={cs['N']}, V={cs['V']}, D={cs['D']}), {cs['regime']}", "",
                  " · ".join(head), "",
                  *C.md_table(["method", "fwd+bwd ms", "fwd+bwd ×compile, paired", "fwd+bwd MiB", "fwd+bwd TFLOP/s",
                               "loss err", "∇E err", "∇C err", "status"], rows), ""]
        paired = [f"- fwd+bwd of `{key}` over `{base}`'s, paired: {r:.3f}" for key, base, r in over_base_paired(cs, meta)]
        lines += [*paired, ""] if paired else []
        paths = [f"- `{k}`: " + ", ".join(f"{name} {n}" for name, n in r["paths"].items())
                 for k, r in cs["methods"].items() if r.get("paths")]
        lines += ["Paths taken (each module's UpstreamState.paths, forwards and backwards by name, over every call "
                  "of the case: accuracy, memory, warm-up and timed):", "", *paths, ""] if paths else []
        lines += post_markdown(cs)
    if data.get("aborted"):
        lines += [f"**run aborted:** {data['aborted']}", ""]
    return "\n".join(lines) + "\n"


def post_markdown(cs: dict) -> list[str]:
    """A case's post-training rows (out["post"]) as a table, with what they measure; [] where it has none."""
    post, get = cs.get("post"), C.get
    if not post:
        return []
    rows = []
    for key, r in post["rows"].items():
        status, what = r.get("status", "?"), O.timing(r["objective"])
        if status not in ("ok", "unavailable"):
            status = f"{status}{' (' + r['stage'] + ')' if r.get('stage') else ''}: {r.get('error', '')[:100]}"
        elif status == "unavailable":
            status = f"unavailable: {r.get('error', '')[:100]}"
        base = "vs_fwd_paired" if r["objective"] == "score" else "vs_mean_paired"
        rows.append([f"`{key}`", r.get("label", key), what.replace("_", "+"), C.fmt_num(get(r, what, "median_ms"), ".2f"),
                     C.fmt_num(get(r, what, base), ".3f"), C.fmt_num(get(r, what, "vs_verl_paired"), ".3f"),
                     C.fmt_mib(r.get(f"{what}_mem_bytes")), C.fmt_num(r.get("mem_vs_compile"), ".3f"),
                     *(C.fmt_num(get(r, f"{x}_rel_err"), ".1e")
                       for x in ("loss", "logp", "entropy", "grad_e", "grad_c")),
                     status])
    paths = [f"- `{k}`: " + ", ".join(f"{name} {n}" for name, n in r["paths"].items())
             for k, r in post["rows"].items() if r.get("paths")]
    ref = post.get("ref", {})
    first = next(iter(ref.values()), None)
    stats = (", ".join(f"{o} {v['loss']:.5g}" for o, v in ref.items() if v.get("loss") is not None)
             + (f"; mean logp {first['logp_mean']:.4f}, mean entropy {first['entropy_mean']:.4f}" if first else ""))
    lines = [f"#### Post-training objectives at T = {post['temperature']:g}", "", (
        f"Each row's time over ours' plain mean (`{post.get('mean_key')}`, forward + backward; a score row: over "
        "ours' training forward, `fwd:ours`) and over verl's of the same objective, paired per round as above; peak "
        f"memory over torch.compile's of the same objective. adv ~ N(0, 1), seed {post.get('adv_seed')}; errors "
        "against an fp32 reference (fp64 softmax statistics) of the same inputs: the objective's value, per-token "
        "logp and entropy (‖x − ref‖ / ‖ref‖ over the tokens), ∇E and ∇C. "
        + "; ".join(f"{o}: {O.OBJECTIVES[o]}" for o in post["objectives"]) + f". Reference: {stats}."), "",
             *C.md_table(["row", "method", "timed", "ms", "× ours' mean (score: × ours' forward), paired",
                          "× verl, paired", "MiB", "MiB × compile", "objective err", "logp err", "entropy err",
                          "∇E err", "∇C err", "status"], rows), ""]
    return lines + (["Paths taken by ours' post-training rows:", "", *paths, ""] if paths else [])


# ---- Main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    methods_help = f"eager, compile, liger, cutce, ours[:<impl>][@<budget>][/{'|/'.join(UPSTREAMS)}]"
    p = C.arg_parser(__doc__, regimes="trained,random", methods=DEFAULT_METHODS, methods_help=methods_help, warmup=2)
    p.add_argument("--shapes", default=",".join(C.MODEL_SHAPES), help="model shapes (or NxVxD)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens N for the model shapes")
    p.add_argument("--objectives", default="mean",
                   help="comma list: " + "; ".join(f"{k}: {v}" for k, v in O.OBJECTIVES.items()))
    p.add_argument("--post-methods", default=O.POST_METHODS,
                   help="the methods of rl, logprobs and score: ours[:<impl>] (ours: cce_kahan_full_c), verl, liger, "
                        "compile, eager")
    p.add_argument("--temperature", type=float, default=1.0, help="T of rl, logprobs and score (logits / T)")
    smoke = {"shapes": ",".join(C.SMOKE_SHAPES), "tokens": 64, "warmup": 1, "repeats": 3, "methods": "eager,ours:torch",
             "post_methods": O.SMOKE_POST_METHODS, "temperature": 0.7}
    args = C.parse_run_args(p, argv, smoke)
    args.objectives = C.csv_list(args.objectives)
    unknown = [o for o in args.objectives if o not in O.OBJECTIVES]
    if unknown or not args.objectives:
        raise SystemExit(f"--objectives: unknown {unknown or 'none given'}; known: {', '.join(O.OBJECTIVES)}")
    if not (args.temperature > 0 and args.temperature < float("inf")):
        raise SystemExit(f"--temperature must be finite and positive, got {args.temperature}")
    return args


def post_run(args, device, dtype) -> tuple[O.PostRun | None, list[str]]:
    """The run's post-training part (None without a post-training objective) and the keys of the mean's
    methods: --methods with `mean`, and ours' plain mean (ours:<impl>) wherever a post-training objective runs
    with ours, its ratios' base."""
    keys = C.csv_list(args.methods) if "mean" in args.objectives else []
    objectives = [o for o in O.POST if o in args.objectives]
    if not objectives:
        return None, keys
    methods = O.build(C.csv_list(args.post_methods), device, dtype)
    ours = next((m for m in methods if m.key == "ours"), None)
    mean_key = f"ours:{ours.info.get('impl') or O.DEFAULT_IMPL}" if ours is not None else None
    if mean_key and not ours.unavailable and mean_key not in keys:
        keys.append(mean_key)
    return O.PostRun(objectives, methods, args.temperature, mean_key), keys


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = C.DTYPES[args.dtype]
    if args.cpu_smoke:
        device, table, default_out = "cpu", C.SMOKE_SHAPES, C.SMOKE_OUT
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or use --cpu-smoke to test the plumbing")
        device, table, default_out = "cuda", C.MODEL_SHAPES, C.RESULTS
        torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [C.parse_shape(s, args.tokens, table) for s in C.csv_list(args.shapes)]
    # Shape-major order: a second regime of the same shape reuses compiled / autotuned kernels.
    cases = [(s, r) for s in shapes for r in args.regimes]
    post, keys = post_run(args, device, dtype)
    methods = build_methods(keys)
    packages = ("liger-kernel", "cut-cross-entropy", "cce-parallel", "megatron-core", "numpy")
    meta = C.run_metadata(device, args, methods, packages + (("verl",) if post else ()), "bench_loss",
                          flop_convention=FLOP_CONVENTION, memory_convention=MEMORY_CONVENTION)
    if post is not None:
        for m in post.methods:
            print(f"[bench_loss] post-training {m.key:<13} {m.label}" + (
                f"  UNAVAILABLE: {m.unavailable}" if m.unavailable else ""), flush=True)
        meta["post"] = {"objectives": {o: O.OBJECTIVES[o] for o in post.objectives}, "temperature": post.temperature,
                        "entropy_coef": O.ENTROPY_COEF, "adv_seed": O.ADV_SEED, "mean_key": post.mean_key,
                        "memory_convention": POST_MEMORY,
                        "methods": {m.key: {"label": m.label, "unavailable": m.unavailable, **m.info}
                                    for m in post.methods}}
    data: dict = {"meta": meta, "cases": []}
    stem = C.out_stem(Path(args.out) if args.out else default_out, meta, args.tag)
    print(f"[bench_loss] {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
          f"commit {meta['git_commit']}", flush=True)
    print(f"[bench_loss] {len(cases)} cases x {len(methods)} methods -> {stem}.{{json,md}}", flush=True)
    start = time.monotonic()
    if C.is_cuda(device):
        data["square_matmul"] = {"n": 8192, **C.matmul_ms(C.Shape("square", 8192, 8192, 8192), device=device,
                                                          dtype=dtype)}

    def run():
        for i, (shape, regime) in enumerate(cases):
            print(f"[{time.monotonic() - start:6.0f}s] case {i + 1}/{len(cases)}: {shape.name} (N={shape.N}, "
                  f"V={shape.V}, D={shape.D}) {regime}", flush=True)
            run_case(shape, regime, methods, args, device, dtype, args.seed + i, data["cases"], post=post)
            for r in data["cases"][-1]["methods"].values():
                print(f"  {r['key']:<28} {r['status']:<6} f+b {C.fmt_num(C.get(r, 'fwd_bwd', 'median_ms'), '.2f')} ms"
                      f"  ×compile {C.fmt_num(C.get(r, 'fwd_bwd', 'vs_compile_paired'), '.3f')}"
                      f"  {C.fmt_mib(r.get('fwd_bwd_mem_bytes'))} MiB  dE {C.fmt_num(C.get(r, 'grad_e_rel_err'), '.1e')}"
                      f"  dC {C.fmt_num(C.get(r, 'grad_c_rel_err'), '.1e')}  {r.get('error', '')[:100]}", flush=True)
            for r in data["cases"][-1].get("post", {}).get("rows", {}).values():
                what = O.timing(r["objective"])
                print(f"  {r['key']:<28} {r['status']:<6} {what.replace('_', '+'):<7} "
                      f"{C.fmt_num(C.get(r, what, 'median_ms'), '.2f')} ms"
                      f"  ×mean {C.fmt_num(C.get(r, what, 'vs_mean_paired'), '.3f')}"
                      f"  ×verl {C.fmt_num(C.get(r, what, 'vs_verl_paired'), '.3f')}"
                      f"  {C.fmt_mib(r.get(f'{what}_mem_bytes'))} MiB"
                      + "".join(f"  {name} {C.fmt_num(r.get(f'{x}_rel_err'), '.1e')}"
                                for name, x in (("logp", "logp"), ("H", "entropy"), ("dE", "grad_e"), ("dC", "grad_c")))
                      + f"  {r.get('error', '')[:100]}", flush=True)
            data["elapsed_s"] = time.monotonic() - start
            C.write_report(stem, data, render_markdown(data))  # partial results survive a killed run

    rc = C.run_guarded(run, data)
    if post is not None:
        O.close(post.methods)
    data["elapsed_s"] = time.monotonic() - start
    written = C.write_report(stem, data, render_markdown(data))
    print(f"[bench_loss] {data['elapsed_s']:.0f} s; wrote " + ", ".join(written), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
