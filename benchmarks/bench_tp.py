"""Loss + gradient under tensor (vocabulary) parallelism: cce_parallel next to the Megatron path.

The same global tokens at every TP size: e [s, b, D], a [V, D] classifier in equal contiguous row
shards, targets [s, b], in groups of t consecutive ranks; methods ``megatron``, ``megatron_fused``
and ``ours:<impl>[@<budget>]`` (``tp_group``). benchmarks/README.md says what is measured.

    torchrun --nproc_per_node 4 -m benchmarks tp --tp 1,2,4 --out DIR --commit SHA
    torchrun --nproc_per_node 2 -m benchmarks tp --cpu-smoke   # gloo: the plumbing
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _common as C
import torch
import torch.distributed as dist

MEGATRON = ("megatron", "megatron_fused")
DEFAULT_METHODS = "megatron,megatron_fused,ours:cce,ours:cce_kahan_full_c,ours:cce_kahan_full_c@lean"
MEMORY_CONVENTION = (
    "per rank: peak torch.cuda.max_memory_allocated above memory_allocated just before the call, "
    "plus what the method keeps allocated between calls (e.g. Megatron's SP all-gather buffer); "
    "MiB (2^20 B); lower bound = bytes of ∇e (this rank's slice under SP) + ∇c_shard "
    "(+ the gathered e under SP)"
)
TIME_CONVENTION = (
    "forward + backward, median of --repeats after --warmup and one untimed accuracy call, CUDA events "
    "on each rank, fresh gradients each call, reduction 'mean', in --rounds rounds that run every "
    "method in turn (one warm-up call per method in each later round); the reported time is the "
    "slowest rank of TP group 0"
)
FLOP_CONVENTION = "per rank: 6·N·(V/t)·D FLOPs for forward + backward (no credit for recomputing logits)"


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device
    backend: str

    @property
    def lead(self) -> bool:
        return self.rank == 0


def init_dist(cpu: bool, timeout_s: float) -> Dist:
    if "RANK" not in os.environ:
        raise SystemExit("launch it with torchrun: torchrun --nproc_per_node N -m benchmarks tp [options]")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = _dt.timedelta(seconds=timeout_s)
    if cpu:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        return Dist(rank, world, torch.device("cpu"), "gloo")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on GPUs, or use --cpu-smoke to test the plumbing")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    return Dist(rank, world, device, "nccl")


def make_tp_group(d: Dist, t: int):
    """Groups of t consecutive ranks (every rank creates every group); returns this rank's."""
    mine = None
    for start in range(0, d.world, t):
        g = dist.new_group(list(range(start, start + t)))
        mine = g if start <= d.rank < start + t else mine
    return mine


# ---- Methods -------------------------------------------------------------------------------------


@dataclass
class Method:
    key: str
    label: str
    kind: str  # "megatron" or "ours"
    impl: str | None = None
    budget: object = "auto"  # ours: logits_budget
    fused: bool = False
    unavailable: str | None = None


def import_megatron():
    """(modules dict, None) or (None, error text)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state
            from megatron.core.model_parallel_config import ModelParallelConfig
            from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

            try:
                from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
            except Exception:  # noqa: BLE001 - only the fused method needs it (reported unavailable)
                fused_vocab_parallel_cross_entropy = None
        return {"ps": parallel_state, "ModelParallelConfig": ModelParallelConfig, "ColumnParallelLinear":
                ColumnParallelLinear, "vpce": vocab_parallel_cross_entropy,
                "fused_vpce": fused_vocab_parallel_cross_entropy}, None
    except Exception as exc:  # noqa: BLE001
        return None, C.short_error(exc)


def build_methods(keys: list[str], mcore, mcore_err) -> list[Method]:
    out: list[Method] = []
    for key in keys:
        if key in MEGATRON:
            fused = key == "megatron_fused"
            label = f"Megatron-core {C.pkg_version('megatron-core')}: ColumnParallelLinear + " + (
                "fused_vocab_parallel_cross_entropy" if fused else "vocab_parallel_cross_entropy")
            unavailable = mcore_err
            if mcore is not None and fused and mcore["fused_vpce"] is None:
                unavailable = "megatron.core.fusions.fused_cross_entropy did not import"
            out.append(Method(key, label, "megatron", fused=fused, unavailable=unavailable))
        elif key == "ours" or key.startswith("ours:"):
            try:
                import cce_parallel

                impls = list(cce_parallel.IMPLS)
            except Exception as exc:  # noqa: BLE001
                out.append(Method(key, "cce_parallel", "ours", unavailable=C.short_error(exc)))
                continue
            for mkey, impl, text, budget in C.expand_ours(key, impls):
                if not any(m.key == mkey for m in out):
                    out.append(Method(mkey, f"cce_parallel {impl}" + (f" @{text}" if text else ""), "ours", impl=impl,
                                      budget=budget,
                                      unavailable=None if impl in impls else f"not in cce_parallel.IMPLS {impls}"))
        else:
            raise SystemExit(f"unknown method {key!r}; known: megatron, megatron_fused, ours, ours:<impl>")
    return out


def make_loss_fn(m: Method, t: int, sp: bool, D: int, V: int, group, mcore, dtype, device) -> Callable:
    """loss_fn(e, c_shard, targets) -> scalar mean loss, for one TP size and SP setting."""
    if m.kind == "ours":
        import cce_parallel

        g = group if t > 1 else None  # at t = 1 the single-GPU library
        return lambda e, c, tg: cce_parallel.linear_cross_entropy(
            e, c, tg, tp_group=g, sequence_parallel=sp, impl=m.impl, logits_budget=m.budget)
    if sp and device.type != "cuda":
        raise NotImplementedError("Megatron's sequence-parallel linear needs CUDA (its all-gather buffer is on the GPU)")
    cfg = mcore["ModelParallelConfig"](tensor_model_parallel_size=t, sequence_parallel=sp, params_dtype=dtype,
                                       gradient_accumulation_fusion=False, perform_initialization=False,
                                       use_cpu_initialization=device.type != "cuda")
    tp_group = mcore["ps"].get_tensor_model_parallel_group()
    layer = mcore["ColumnParallelLinear"](D, V, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                          gather_output=False, skip_weight_param_allocation=True, tp_group=tp_group)
    fvpce, vpce = mcore["fused_vpce"], mcore["vpce"]

    def meg(e, c, tg):
        logits, _ = layer(e, weight=c)  # [s, b, V/t] bf16; with SP, e is gathered inside
        # per-token loss [s, b] -> mean over the N tokens
        return (fvpce(logits, tg, tp_group) if m.fused else vpce(logits, tg)).mean()

    return meg


# ---- Measuring -----------------------------------------------------------------------------------


def allocated(device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def measure(m: Method, make: Callable, e, c, tg, ref, d: Dist):
    """One method on this rank but its time (C.measure), and what it keeps allocated between calls."""
    t1 = time.perf_counter()
    C.free_memory(d.device)
    before = allocated(d.device)
    res, fn = C.measure(make, e, c, tg, device=d.device, ref=ref, mem_key="peak_bytes", trace=True)
    after = allocated(d.device)
    if fn is not None and before is not None and after is not None:
        res["persistent_bytes"] = max(0, after - before)
        res["mem_bytes"] = res["peak_bytes"] + res["persistent_bytes"]
    if fn is None:
        print(f"[bench_tp rank {d.rank}] {m.key} FAILED at {res['stage']}:\n{res['traceback']}", file=sys.stderr,
              flush=True)
    res["wall_s"] = time.perf_counter() - t1
    return res, fn


def combine(per_rank: list[dict], t: int) -> dict:
    """One record from every rank's result: group 0's slowest time, the largest memory and error."""
    out: dict = {"status": "ok"}
    bad = [(r, x) for r, x in enumerate(per_rank) if x.get("status") != "ok"]
    if bad:
        r, x = bad[0]
        out.update(status=x["status"], stage=x.get("stage"), error=f"rank {r}: {x.get('error')}")
        out["failed_ranks"] = [r for r, _ in bad]
    meds = [x.get("fwd_bwd", {}).get("median_ms") for x in per_rank]
    if all(v is not None for v in meds[:t]):
        slowest = max(range(t), key=lambda r: meds[r])
        out["fwd_bwd"] = {**per_rank[slowest]["fwd_bwd"], "rank": slowest}
        out["tflops"] = per_rank[slowest]["tflops"]
    for key in ("mem_bytes", "peak_bytes", "persistent_bytes", "loss_rel_err", "grad_e_rel_err", "grad_c_rel_err"):
        vals = [x.get(key) for x in per_rank if x.get(key) is not None]
        out[key] = max(vals) if vals else None
    out["loss"] = per_rank[0].get("loss")
    return out


def init_megatron(mcore, t: int, tp_rank: int):
    """True, or why Megatron's model parallel state for TP size t could not be set up."""
    try:
        ps = mcore["ps"]
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ps.initialize_model_parallel(tensor_model_parallel_size=t, create_gloo_process_groups=False)
        if ps.get_tensor_model_parallel_rank() != tp_rank or ps.get_tensor_model_parallel_world_size() != t:
            raise RuntimeError(f"Megatron's TP group (rank {ps.get_tensor_model_parallel_rank()} of "
                               f"{ps.get_tensor_model_parallel_world_size()}) is not ranks of consecutive blocks of {t}")
        return True
    except Exception as exc:  # noqa: BLE001
        return C.short_error(exc)


def run_tp(t: int, d: Dist, args, methods, mcore, dtype, shape: C.Shape, data: dict, save: Callable):
    """Every regime and SP setting at TP size t; rank 0 adds the cases to data and saves each method's result."""
    s, b, N, V, D = args.seq, args.batch, shape.N, shape.V, shape.D
    elem = torch.finfo(dtype).bits // 8
    group = make_tp_group(d, t) if t > 1 else None
    tp_rank, V_loc = d.rank % t, V // t
    lo, hi = tp_rank * V_loc, (tp_rank + 1) * V_loc
    mcore_ready = None
    if mcore is not None and any(m.kind == "megatron" and not m.unavailable for m in methods):
        mcore_ready = init_megatron(mcore, t, tp_rank)
        if mcore_ready is not True:
            print(f"[bench_tp rank {d.rank}] initialize_model_parallel({t}) failed: {mcore_ready}", file=sys.stderr)
    for ri, regime in enumerate(args.regimes):
        seed, t0 = args.seed + ri, time.perf_counter()
        e, c, tg = C.make_inputs(shape, regime, dtype=dtype, device=d.device, seed=seed)
        for x in (e, c, tg):  # seeded alike, but make sure: TP ranks must see identical inputs
            dist.broadcast(x, src=0)
        stats = C.softmax_stats(e, c, tg, rows=1024 if not args.cpu_smoke else 32) if d.lead else None
        ref_loss, ref_ge, ref_gc = C.reference_loss_grads(e, c, tg)
        c_shard = c[lo:hi].clone().requires_grad_(True)
        targets, e_sb = tg.view(s, b), e.view(s, b, D)
        ref_gc = ref_gc[lo:hi].clone()  # the full one is freed
        del c, tg
        setup_s = time.perf_counter() - t0
        for sp in [sp for sp in args.sp_list if t > 1 or not sp]:
            rows = (s // t) * b if sp else N
            case = {"regime": regime, "tp": t, "sp": sp, "world": d.world, "groups": d.world // t, "N": N, "s": s,
                    "b": b, "V": V, "D": D, "V_shard": V_loc, "dtype": str(dtype).replace("torch.", ""), "seed": seed,
                    "softmax": stats, "ref_loss": ref_loss, "setup_s": setup_s,
                    "lower_bound_parts": {"grad_e": rows * D * elem, "grad_c_shard": V_loc * D * elem,
                                          "gathered_e": N * D * elem if sp else 0},
                    "flops_per_rank": 6.0 * N * V_loc * D, "methods": {}}
            case["lower_bound_bytes"] = sum(case["lower_bound_parts"].values())
            if d.lead:
                data["cases"].append(case)
                print(f"[{time.monotonic() - data['_start']:6.0f}s] TP={t} SP={'on' if sp else 'off'} {regime}: "
                      f"N={N} V={V} (shard {V_loc}) D={D}; bound {C.fmt_mib(case['lower_bound_bytes'])} MiB/rank",
                      flush=True)
            # SP rank r holds token rows r·(s/t)·b ... of the flattened [s, b]
            mine_rows = slice(tp_rank * (s // t), (tp_rank + 1) * (s // t)) if sp else slice(None)
            e_loc = e_sb[mine_rows].clone().requires_grad_(True)
            ref = (ref_loss, ref_ge[tp_rank * (s // t) * b:(tp_rank + 1) * (s // t) * b] if sp else ref_ge, ref_gc)
            entries, alive = {}, []
            try:
                for m in methods:
                    entry = entries[m.key] = {"key": m.key, "label": m.label}
                    if m.unavailable:
                        entry.update(status="unavailable", error=m.unavailable)
                        continue
                    if m.kind == "megatron" and mcore_ready is not True:
                        entry.update(status="error", error=f"initialize_model_parallel({t}): {mcore_ready}")
                        continue
                    if m.kind == "megatron" and sp and d.device.type != "cuda":
                        entry.update(status="skipped", error="Megatron's SP linear needs CUDA (CPU smoke mode)")
                        continue
                    if m.kind == "megatron":  # its SP all-gather buffer is counted to the method that makes it
                        mcore["ps"].get_global_memory_buffer().buffer.clear()
                    try:
                        mine, fn = measure(m, lambda m=m, sp=sp: make_loss_fn(m, t, sp, D, V, group, mcore, dtype,
                                                                              d.device), e_loc, c_shard, targets, ref, d)
                    except C.FatalCudaError as exc:
                        entry["_mine"] = exc.result
                        raise
                    entry["_mine"] = mine
                    failed = torch.tensor([int(fn is None)], dtype=torch.int32, device=d.device)
                    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
                    if not failed.item():  # timed only where every rank has it
                        alive.append((mine, fn))
                t1 = time.perf_counter()
                # Every rank runs the same sequence (collectives must meet).
                C.time_fwd_bwd(alive, e_loc, c_shard, targets, args, device=d.device, flops=case["flops_per_rank"],
                               tflops_key="tflops")
            except C.FatalCudaError:
                # The context is gone: rank 0 keeps what it measured (no collectives any more); the other
                # ranks stop at their next collective (--nccl-timeout) and torchrun ends them.
                if d.lead:
                    for key, entry in entries.items():
                        mine = entry.pop("_mine", None) or {}
                        case["methods"][key] = {**entry, **{k: v for k, v in mine.items()
                                                            if k in ("status", "stage", "error")}}
                raise
            for mine, _ in alive:
                mine["wall_s"] += (time.perf_counter() - t1) / len(alive)
            del alive
            for m in methods:
                entry = entries[m.key]
                mine = entry.pop("_mine", None)
                if mine is not None:
                    per_rank = [None] * d.world
                    dist.all_gather_object(per_rank, mine)
                    entry.update(combine(per_rank, t))
                    entry["wall_s"] = max(r.get("wall_s", 0.0) for r in per_rank)
                if d.lead:
                    case["methods"][m.key] = entry
                    save()
            del e_loc, ref
            C.free_memory(d.device)
        del e, e_sb, c_shard, targets, ref_ge, ref_gc
        C.free_memory(d.device)


# ---- Reports: Markdown, from the JSON alone ------------------------------------------------------


def _ms(r: dict | None):
    return C.get(r, "fwd_bwd", "median_ms") if r and r.get("status") == "ok" else None


def _over(a, b):
    return a / b if a and b else None


def render_markdown(data: dict) -> str:
    meta, cfg = data["meta"], data["meta"].get("config", {})
    lines = ["# Loss + gradient under tensor parallelism: cce_parallel next to the Megatron path", "",
             (f"- device: {meta['world']} × {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
              f"CUDA {meta.get('cuda')}, Python {meta.get('python')}; "
              f"megatron-core {meta.get('packages', {}).get('megatron-core')}"),
             f"- commit: `{meta['git_commit']}`; date: {meta['date']}", f"- command: `{meta.get('launch')}`",
             (f"- shape: N = {cfg.get('N')} tokens (s = {cfg.get('s')}, b = {cfg.get('b')}, [s, b, D] layout), "
              f"V = {cfg.get('V')}, D = {cfg.get('D')}, {cfg.get('dtype')}; the same global tokens at every TP size"),
             ("- TP groups: consecutive ranks; every group runs the same work; times are TP group 0's slowest "
              f"rank, memory the largest over all {meta['world']} ranks; backend {meta.get('backend')}"),
             f"- timing: {TIME_CONVENTION} (warm-up {meta.get('warmup')}, repeats {meta.get('repeats')})",
             f"- memory: {MEMORY_CONVENTION}", f"- FLOPs: {FLOP_CONVENTION}",
             ("- errors: ‖x − ref‖_F / ‖ref‖_F against an fp32 reference on the full classifier (∇e: this "
              "rank's rows under SP; ∇c: this rank's shard), largest over ranks"),
             f"- env: {', '.join(f'{k}={v}' for k, v in sorted(meta.get('env', {}).items())) or 'none recorded'}",
             "", "Regimes:"]
    lines += [f"- **{r}**: {text}" for r, text in meta.get("regimes", {}).items()]
    for regime in dict.fromkeys(cs["regime"] for cs in data["cases"]):
        cases = sorted([cs for cs in data["cases"] if cs["regime"] == regime], key=lambda x: (x["tp"], x["sp"]))
        sm, rows = cases[0].get("softmax") or {}, []
        tp1 = next((cs["methods"] for cs in cases if (cs["tp"], cs["sp"]) == (1, False)), {})
        for cs in cases:
            for key, r in cs["methods"].items():
                ours, ms, mega = key.startswith("ours:"), _ms(r), [cs["methods"].get(k) for k in MEGATRON]
                # × Megatron (fused): its time over ours, ours' memory over its; × own TP=1: that time over this
                vs = [C.fmt_num(_over(_ms(m), ms), ".2f") if ours else "" for m in mega]
                vs_mem = [C.fmt_num(_over(C.get(r, "mem_bytes"), C.get(m, "mem_bytes")) if ours else None, ".2f")
                          for m in mega]
                status = r.get("status", "?")
                if status != "ok":
                    status = " ".join(x for x in (f"{status}:", r.get("stage"), (r.get("error") or "")[:90]) if x)
                rows.append([cs["tp"], "on" if cs["sp"] else "off", r.get("label", key),
                             C.fmt_num(ms if status == "ok" else C.get(r, "fwd_bwd", "median_ms"), ".2f"),
                             C.fmt_num(C.get(r, "tflops"), ".0f"), *vs, C.fmt_num(_over(_ms(tp1.get(key)), ms), ".2f"),
                             C.fmt_mib(C.get(r, "mem_bytes")), C.fmt_mib(cs["lower_bound_bytes"]), *vs_mem,
                             *(C.fmt_num(C.get(r, f"{x}_rel_err"), ".1e") for x in ("loss", "grad_e", "grad_c")), status])
        lines += ["", f"## {regime}", "",
                  (f"softmax entries ≥ 2^-12: {C.fmt_num(100 * (C.get(sm, 'frac_ge_eps') or 0), '.4f')} % "
                   f"({C.fmt_num(C.get(sm, 'entries_ge_eps_per_row'), '.1f')} per row) · median p(target) "
                   f"{C.fmt_num(C.get(sm, 'p_target_median'), '.3f')} · fp32 loss "
                   f"{C.fmt_num(C.get(cases[0], 'ref_loss'), '.4f')}"), "",
                  *C.md_table(["TP", "SP", "method", "fwd+bwd ms", "TFLOP/s/rank", "× Megatron", "× Megatron fused",
                               "× own TP=1", "MiB/rank", "bound MiB", "× Megatron MiB", "× Megatron fused MiB",
                               "loss err", "∇E err", "∇C err", "status"], rows)]
    if data.get("aborted"):
        lines += ["", f"**Run aborted:** {data['aborted']}"]
    if data.get("failures"):
        lines += ["", "**Failures:**"] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


# ---- Main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = C.arg_parser(__doc__, regimes="random", methods=DEFAULT_METHODS, warmup=3,
                     methods_help="megatron, megatron_fused, ours, ours:<impl>[@<budget>]")
    p.add_argument("--tp", default="1,2,4", help="TP sizes; each must divide the world size")
    p.add_argument("--sp", default="off,on", help="sequence parallelism: off, on or off,on (on only for TP > 1)")
    p.add_argument("--shape", default="gemma2-2b", choices=list(C.MODEL_SHAPES), help="head (V, D)")
    p.add_argument("--seq", type=int, default=4096, help="s: sequence length (global); N = s·b")
    p.add_argument("--batch", type=int, default=2, help="b: micro-batch size")
    p.add_argument("--nccl-timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    smoke = {"seq": 16, "warmup": 1, "repeats": 3, "methods": "megatron,megatron_fused,ours:torch"}
    args = C.parse_run_args(p, argv, smoke)
    sp_words = C.csv_list(args.sp)
    if not sp_words or any(w not in ("off", "on") for w in sp_words):
        raise SystemExit("--sp takes off, on or off,on")
    args.sp_list = [w == "on" for w in dict.fromkeys(sp_words)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")  # recorded in meta.env instead
    dtype = C.DTYPES[args.dtype]
    if not args.cpu_smoke:
        torch.backends.cuda.matmul.allow_tf32 = False
    V, D = C.SMOKE_SHAPES["tiny-b"] if args.cpu_smoke else C.MODEL_SHAPES[args.shape]
    shape = C.Shape(args.shape if not args.cpu_smoke else f"V{V}", args.seq * args.batch, V, D)
    tp_sizes = [int(x) for x in C.csv_list(args.tp)]
    d = init_dist(args.cpu_smoke, args.nccl_timeout)
    if args.cpu_smoke and args.tp == "1,2,4":
        tp_sizes = [t for t in tp_sizes if d.world % t == 0]
    bad = [t for t in tp_sizes if t < 1 or d.world % t or V % t or (True in args.sp_list and t > 1 and args.seq % t)]
    if bad:
        print(f"[bench_tp rank {d.rank}] TP sizes {bad} must divide the world ({d.world}), V ({V}) and, with SP, "
              f"s ({args.seq})", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2

    mcore, mcore_err = import_megatron()
    methods = build_methods(C.csv_list(args.methods), mcore, mcore_err)
    launch = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    meta = C.run_metadata(d.device, args, methods if d.lead else [], ("megatron-core", "cce-parallel", "numpy"),
                          "bench_tp", world=d.world, backend=d.backend, tp_sizes=tp_sizes, sp=args.sp_list,
                          launch=f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', d.world)} "
                                 f"-m benchmarks tp {launch}",
                          config={"N": shape.N, "s": args.seq, "b": args.batch, "V": V, "D": D, "dtype": args.dtype,
                                  "shape": args.shape}, time_convention=TIME_CONVENTION,
                          memory_convention=MEMORY_CONVENTION, flop_convention=FLOP_CONVENTION)
    meta["env"].update({k: v for k, v in os.environ.items() if k.startswith("NCCL_")
                        or k in ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")})
    data: dict = {"meta": meta, "cases": [], "_start": time.monotonic()}
    stem = C.out_stem(Path(args.out) if args.out else (C.SMOKE_OUT if args.cpu_smoke else C.RESULTS), meta,
                      "tp" + (f"_{args.tag}" if args.tag else ""))

    def save():
        if d.lead:
            data["elapsed_s"] = time.monotonic() - data["_start"]
            C.write_report(stem, data, render_markdown(data))

    if d.lead:
        print(f"[bench_tp] {d.world} × {meta['device']} ({d.backend}) | torch {meta['torch']} | "
              f"megatron-core {meta['packages']['megatron-core']} | commit {meta['git_commit']}", flush=True)

    def run():
        for t in tp_sizes:
            run_tp(t, d, args, methods, mcore, dtype, shape, data, save)

    rc = C.run_guarded(run, data, f" on rank {d.rank}")
    if d.lead:
        expected = ("unavailable", "skipped") if args.cpu_smoke else ("skipped",)
        fails = [f"TP={cs['tp']} SP={'on' if cs['sp'] else 'off'} {cs['regime']} {k}: {r.get('status')} "
                 f"{r.get('stage') or ''} {(r.get('error') or '')[:200]}".replace("  ", " ")
                 for cs in data["cases"] for k, r in cs["methods"].items()
                 if r.get("status") != "ok" and r.get("status") not in expected]
        if fails:
            data["failures"] = fails
        save()
        print(f"[bench_tp] {data['elapsed_s']:.0f} s; wrote {stem}.json, {stem}.md", flush=True)
        if fails:
            print("[bench_tp] FAILURES:\n  " + "\n  ".join(fails), file=sys.stderr, flush=True)
            rc = rc or 1
    if rc in (0, 1):
        with contextlib.suppress(Exception):  # shutting down anyway
            dist.barrier()
            dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
