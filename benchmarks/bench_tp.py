"""Loss + gradient under tensor (vocabulary) parallelism: cce_parallel next to the Megatron path.

Same global tokens at every TP size: hidden states e [s, b, D] (N = s·b tokens), a [V, D]
classifier split into equal contiguous row shards, targets [s, b] in the full vocabulary. For each
TP size t the world (torchrun ranks) is cut into groups of t consecutive ranks; every group runs
the same work and the report is group 0's (memory: the largest over all ranks). Per (regime, t,
sequence_parallel, method) it measures, on every rank:

- forward + backward time: median of --repeats calls after --warmup (and one untimed accuracy
  call), CUDA events, fresh gradients every call, reduction "mean" over the N tokens;
- peak memory above the inputs (torch.cuda.max_memory_allocated above memory_allocated just before
  the call) plus what the method keeps allocated between calls (Megatron's global all-gather
  buffer under sequence parallelism), next to the rank's lower bound: bytes of ∇e (full, or this
  rank's slice under SP) + ∇c_shard, plus the gathered e under SP;
- loss, ∇e and ∇c_shard relative error against an fp32 reference on the full classifier.

Methods:
- ``megatron``: the unfused Megatron-core path, exactly as GPTModel's output layer runs it:
  ``ColumnParallelLinear`` (gather_output=False, bias=False, the classifier shard passed as
  ``weight``; with SP it all-gathers e and reduce-scatters ∇e itself) + ``vocab_parallel_cross_entropy``
  on the bf16 logits, then ``.mean()``. Needs ``parallel_state.initialize_model_parallel(t)``,
  re-initialized for each t.
- ``megatron_fused``: the same logits + ``fused_vocab_parallel_cross_entropy``, what GPTModel runs
  with ``cross_entropy_loss_fusion`` (``cross_entropy_fusion_impl='native'``, the one Megatron-LM's
  argument check allows): the same math in torch.compile'd pieces, the forward's last two
  all-reduces batched into one, and a bf16 logit gradient. Every report compares ours with both.
- ``ours:<impl>``: ``cce_parallel.linear_cross_entropy(e, c_shard, targets, tp_group=...,
  sequence_parallel=..., impl=<impl>)``; at t = 1 without a group (the single-GPU library).
  ``ours`` expands to every Triton impl.

SP is run for t > 1 only (at t = 1 it is the same computation; Megatron refuses it).

Launch:
    torchrun --nproc_per_node 4 benchmarks/bench_tp.py --tp 1,2,4 --out DIR --commit SHA
    benchmarks/run_bench_tp.sh DIR --commit SHA        # one launch per TP size, then --render
    torchrun --nproc_per_node 2 benchmarks/bench_tp.py --cpu-smoke   # gloo, tiny, tests the plumbing
    python benchmarks/bench_tp.py --render a.json b.json --out DIR  # merge results, no GPU

Results: <out>/<gpu>_<yyyymmdd>_tp[_<tag>].{json,md}, rewritten by rank 0 after every method.
A method that fails is recorded (status "error"/"oom", with the rank and stage) and the run goes
on; the exit code is then 1 (GPU mode), so failures are never silent. A CUDA error that breaks the
context stops the run (exit 3) after writing what was measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _common as C
import torch
import torch.distributed as dist

DEFAULT_METHODS = "megatron,megatron_fused,ours:cce,ours:cce_kahan_full_c,ours:cce_kahan_full_c@lean"
SMOKE_METHODS = "megatron,megatron_fused,ours:torch"
# Megatron's two loss paths, each a baseline of the "× Megatron" columns and targets.
MEGATRON_BASELINES = {"megatron": "Megatron path", "megatron_fused": "Megatron fused path"}
# The issue's Megatron measurements (4×H200, NVLink, N=8,192, Gemma 2 2B head): ms, GB per rank.
ISSUE_MEGATRON = {1: (73.2, 14.8), 2: (36.7, 7.4), 4: (18.2, 3.7)}
# Issue 12's criterion 3: >= 1.4x faster than Megatron's path at <= 0.5x its memory per rank, TP4 >= 3.6x TP1.
TARGET_VS_MEGATRON = 1.4
TARGET_MEMORY_VS_MEGATRON = 0.5
TARGET_TP4_SCALING = 3.6
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


class FatalCudaError(RuntimeError):
    """The CUDA context is broken: nothing more can run."""


# ----------------------------------------------------------------------------------------------
# Distributed setup
# ----------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def lead(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(cpu: bool, timeout_s: float) -> Dist:
    if "RANK" not in os.environ:  # plain `python bench_tp.py`: a world of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    timeout = _dt.timedelta(seconds=timeout_s)
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on GPUs, or use --cpu-smoke to test the plumbing")
        if local >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
        backend = "nccl"
    return Dist(rank, world, local, device, backend)


def make_tp_group(d: Dist, t: int):
    """Groups of t consecutive ranks (every rank creates every group); returns this rank's."""
    mine = None
    for start in range(0, d.world, t):
        ranks = list(range(start, start + t))
        g = dist.new_group(ranks)
        if d.rank in ranks:
            mine = g
    return mine


def any_rank(flag: bool, d: Dist) -> bool:
    x = torch.tensor([1 if flag else 0], dtype=torch.int32, device=d.device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return bool(x.item())


def gather_objects(obj, d: Dist) -> list:
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------


@dataclass
class Method:
    key: str
    label: str
    kind: str  # "megatron" or "ours"
    impl: str | None = None
    budget: object = "auto"  # ours: logits_budget
    fused: bool = False
    unavailable: str | None = None
    info: dict = field(default_factory=dict)


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
        return {
            "ps": parallel_state,
            "ModelParallelConfig": ModelParallelConfig,
            "ColumnParallelLinear": ColumnParallelLinear,
            "vpce": vocab_parallel_cross_entropy,
            "fused_vpce": fused_vocab_parallel_cross_entropy,
        }, None
    except Exception as exc:  # noqa: BLE001
        return None, C.short_error(exc)


def build_methods(keys: list[str], mcore, mcore_err) -> list[Method]:
    out: list[Method] = []
    mver = C.pkg_version("megatron-core")
    for key in keys:
        if key in ("megatron", "megatron_fused"):
            fused = key == "megatron_fused"
            label = f"Megatron-core {mver}: ColumnParallelLinear + " + (
                "fused_vocab_parallel_cross_entropy" if fused else "vocab_parallel_cross_entropy"
            )
            unavailable = mcore_err
            if mcore is not None and fused and mcore["fused_vpce"] is None:
                unavailable = "megatron.core.fusions.fused_cross_entropy did not import"
            out.append(
                Method(key, label, "megatron", fused=fused, unavailable=unavailable, info={"version": mver})
            )
        elif key == "ours" or key.startswith("ours:"):
            try:
                import cce_parallel

                impls = list(cce_parallel.IMPLS)
            except Exception as exc:  # noqa: BLE001
                out.append(Method(key, "cce_parallel", "ours", unavailable=C.short_error(exc)))
                continue
            impl_part, budget_part, budget = C.parse_ours(key)
            wanted = [impl_part] if impl_part else [i for i in impls if i != "torch"]
            for impl in wanted:
                mkey = f"ours:{impl}" + (f"@{budget_part}" if budget_part else "")
                if any(m.key == mkey for m in out):
                    continue
                bad = None if impl in impls else f"not in cce_parallel.IMPLS {impls}"
                label = f"cce_parallel {impl}" + (f" @{budget_part}" if budget_part else "")
                out.append(
                    Method(
                        mkey, label, "ours", impl=impl, budget=budget, unavailable=bad,
                        info={"impl": impl, "logits_budget": budget},
                    )
                )
        else:
            raise SystemExit(f"unknown method {key!r}; known: megatron, megatron_fused, ours, ours:<impl>")
    return out


def make_loss_fn(m: Method, t: int, sp: bool, D: int, V: int, group, mcore, dtype, device) -> Callable:
    """loss_fn(e, c_shard, targets) -> scalar mean loss, for one TP size and SP setting."""
    if m.kind == "ours":
        import cce_parallel

        g = group if t > 1 else None

        def ours(e, c, tg, impl=m.impl, budget=m.budget, g=g, sp=sp):
            return cce_parallel.linear_cross_entropy(
                e, c, tg, tp_group=g, sequence_parallel=sp, impl=impl, logits_budget=budget
            )

        return ours

    ps = mcore["ps"]
    if sp and device.type != "cuda":
        raise NotImplementedError(
            "Megatron's sequence-parallel linear needs CUDA (its all-gather buffer is on the GPU)"
        )
    cfg = mcore["ModelParallelConfig"](
        tensor_model_parallel_size=t,
        sequence_parallel=sp,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
        perform_initialization=False,
        use_cpu_initialization=device.type != "cuda",
    )
    layer = mcore["ColumnParallelLinear"](
        D,
        V,
        config=cfg,
        init_method=torch.nn.init.zeros_,
        bias=False,
        gather_output=False,
        skip_weight_param_allocation=True,
        tp_group=ps.get_tensor_model_parallel_group(),
    )
    tp_group = ps.get_tensor_model_parallel_group()
    if m.fused:
        fvpce = mcore["fused_vpce"]

        def meg_fused(e, c, tg):
            logits, _ = layer(e, weight=c)
            return fvpce(logits, tg, tp_group).mean()

        return meg_fused
    vpce = mcore["vpce"]

    def meg(e, c, tg):
        logits, _ = layer(e, weight=c)  # [s, b, V/t] bf16; with SP, e is gathered inside
        return vpce(logits, tg).mean()  # per-token loss [s, b] -> mean over the N tokens

    return meg


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    e: torch.Tensor  # this rank's e: [s, b, D], or [s/t, b, D] under SP (leaf, requires grad)
    c: torch.Tensor  # this rank's classifier shard [V/t, D] (leaf, requires grad)
    t: torch.Tensor  # targets [s, b]
    ref_loss: float | None
    ref_ge: torch.Tensor | None  # fp32 reference ∇e rows matching e (flattened [rows, D])
    ref_gc: torch.Tensor | None  # fp32 reference ∇c rows of this shard


def allocated(device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def measure(m: Method, fn_builder: Callable, x: Inputs, args, d: Dist):
    """One method on this rank but its forward + backward time (timed_rounds takes that); every
    failure is recorded with its stage (fatal CUDA errors raise). Returns (result, loss_fn or None)."""
    res: dict = {"status": "ok"}
    e, c, t = x.e, x.c, x.t

    def clear():
        e.grad = None
        c.grad = None

    stage = "build"
    fn = None
    try:
        C.free_memory(d.device)
        before = allocated(d.device)
        fn = fn_builder()

        def fwd_bwd():
            loss = fn(e, c, t)
            loss.backward()
            return loss

        stage = "accuracy"
        clear()
        loss = fwd_bwd()
        C.sync(d.device)
        res["loss"] = float(loss.detach().float())
        if x.ref_ge is not None:
            res["loss_rel_err"] = abs(res["loss"] - x.ref_loss) / abs(x.ref_loss)
            res["grad_e_rel_err"] = (
                C.rel_err(e.grad.reshape(-1, e.shape[-1]), x.ref_ge) if e.grad is not None else None
            )
            res["grad_c_rel_err"] = C.rel_err(c.grad, x.ref_gc) if c.grad is not None else None
        del loss
        clear()

        if args.fwd:
            stage = "fwd"
            times = C.time_ms(
                lambda: fn(e, c, t), device=d.device, warmup=args.warmup, repeats=args.repeats, setup=clear
            )
            res["fwd"] = C.summarize_times(times)

        stage = "fwd+bwd memory"
        clear()
        res["peak_bytes"] = C.peak_bytes(fwd_bwd, device=d.device)
        clear()
        C.free_memory(d.device)
        after = allocated(d.device)
        if before is not None and after is not None:
            res["persistent_bytes"] = max(0, after - before)
            res["mem_bytes"] = res["peak_bytes"] + res["persistent_bytes"]
    except Exception as exc:  # noqa: BLE001 - recorded, then the run goes on
        res["status"] = "oom" if C.is_oom(exc) else "error"
        res["stage"] = stage
        res["error"] = C.short_error(exc)
        res["traceback"] = traceback.format_exc(limit=8)
        print(
            f"[bench_tp rank {d.rank}] {m.key} FAILED at {stage}:\n{res['traceback']}",
            file=sys.stderr,
            flush=True,
        )
        if C.is_fatal_cuda_error(exc):
            raise FatalCudaError(res["error"]) from None
    finally:
        clear()
        C.free_memory(d.device)
    return res, (fn if res["status"] == "ok" else None)


def timed_rounds(alive: list, x: Inputs, args, d: Dist, flops: float) -> None:
    """Forward + backward time of every method in `alive` [(result, loss_fn)] on this rank, side by
    side in --rounds rounds (C.time_in_rounds), --repeats timed calls each. Every rank runs the same
    sequence (the methods' collectives must meet), so `alive` must hold the same methods on every rank."""
    e, c, t = x.e, x.c, x.t

    def clear():
        e.grad = None
        c.grad = None

    calls = [(i, lambda fn=fn: fn(e, c, t).backward()) for i, (_, fn) in enumerate(alive)]
    timed = C.time_in_rounds(
        calls, device=d.device, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds, setup=clear
    )
    fatal = None
    for i, (times, exc) in timed.items():
        res = alive[i][0]
        if exc is not None:
            res.update(status="oom" if C.is_oom(exc) else "error", stage="fwd+bwd", error=C.short_error(exc))
            fatal = fatal or (res["error"] if C.is_fatal_cuda_error(exc) else None)
        else:
            res["times_ms"] = times
            res["fwd_bwd"] = C.summarize_times(times)
            res["tflops"] = flops / (res["fwd_bwd"]["median_ms"] * 1e-3) / 1e12
    if fatal is not None:
        raise FatalCudaError(fatal)


def combine(per_rank: list[dict], t: int) -> dict:
    """One record from every rank's result: group 0's slowest time, the largest memory and error."""
    out: dict = {"status": "ok"}
    bad = [(r, x) for r, x in enumerate(per_rank) if x.get("status") != "ok"]
    if bad:
        r, x = bad[0]
        out.update(status=x["status"], stage=x.get("stage"), error=f"rank {r}: {x.get('error')}")
        out["failed_ranks"] = [r for r, _ in bad]
    group0 = per_rank[:t]
    meds = [x.get("fwd_bwd", {}).get("median_ms") for x in per_rank]
    if all(v is not None for v in meds[:t]):
        slowest = max(range(t), key=lambda r: meds[r])
        out["fwd_bwd"] = group0[slowest]["fwd_bwd"]
        out["fwd_bwd"]["rank"] = slowest
        out["times_ms"] = group0[slowest].get("times_ms")
        out["tflops"] = group0[slowest]["tflops"]
    out["per_rank_median_ms"] = meds
    fwd = [x.get("fwd", {}).get("median_ms") for x in group0]
    if fwd and all(v is not None for v in fwd):
        out["fwd_ms"] = max(fwd)

    def biggest(key):
        vals = [x.get(key) for x in per_rank if x.get(key) is not None]
        return max(vals) if vals else None

    for key in (
        "mem_bytes",
        "peak_bytes",
        "persistent_bytes",
        "loss_rel_err",
        "grad_e_rel_err",
        "grad_c_rel_err",
    ):
        out[key] = biggest(key)
    out["per_rank_mem_bytes"] = [x.get("mem_bytes") for x in per_rank]
    losses = [x.get("loss") for x in per_rank if x.get("loss") is not None]
    if losses:
        out["loss"] = per_rank[0].get("loss", losses[0])
        out["loss_spread"] = max(losses) - min(losses)
    return out


# ----------------------------------------------------------------------------------------------
# One TP size
# ----------------------------------------------------------------------------------------------


def full_inputs(shape: C.Shape, regime: str, args, d: Dist, dtype, seed: int):
    """Same seeded full e [N, D], c [V, D], targets [N] on every rank (+ fp32 reference, stats)."""
    e, c, t = C.make_inputs(shape, regime, dtype=dtype, device=d.device, seed=seed)
    for x in (e, c, t):  # seeded alike, but make sure: TP ranks must see identical inputs
        dist.broadcast(x, src=0)
    stats = C.softmax_stats(e, c, t, rows=args.stats_rows) if d.lead else None
    ref = None if args.no_errors else C.reference_loss_grads(e, c, t)
    return e, c, t, stats, ref


def run_tp(
    t: int, d: Dist, args, methods, mcore, dtype, shape: C.Shape, data: dict, save: Callable, deadline
) -> None:
    s, b = args.seq, args.batch
    N, V, D = shape.N, shape.V, shape.D
    elem = torch.finfo(dtype).bits // 8
    group = make_tp_group(d, t) if t > 1 else None
    tp_rank = d.rank % t
    mcore_ready = None
    if mcore is not None and any(m.kind == "megatron" and not m.unavailable for m in methods):
        try:
            ps = mcore["ps"]
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ps.initialize_model_parallel(tensor_model_parallel_size=t, create_gloo_process_groups=False)
            if (
                ps.get_tensor_model_parallel_rank() != tp_rank
                or ps.get_tensor_model_parallel_world_size() != t
            ):
                raise RuntimeError(
                    f"Megatron's TP group (rank {ps.get_tensor_model_parallel_rank()} of "
                    f"{ps.get_tensor_model_parallel_world_size()}) is not ranks of consecutive blocks of {t}"
                )
            mcore_ready = True
        except Exception as exc:  # noqa: BLE001
            mcore_ready = C.short_error(exc)
            print(
                f"[bench_tp rank {d.rank}] initialize_model_parallel({t}) failed: {mcore_ready}",
                file=sys.stderr,
            )

    sp_list = [sp for sp in args.sp_list if t > 1 or not sp]
    V_loc = V // t
    lo, hi = tp_rank * V_loc, (tp_rank + 1) * V_loc
    for ri, regime in enumerate(args.regimes):
        seed = args.seed + ri
        t0 = time.perf_counter()
        e, c, tg, stats, ref = full_inputs(shape, regime, args, d, dtype, seed)
        c_shard = c[lo:hi].clone().requires_grad_(True)
        targets = tg.view(s, b)
        e_sb = e.view(s, b, D)
        ref_gc = ref[2][lo:hi].clone() if ref is not None else None
        del c, tg
        if ref is not None:
            ref = (ref[0], ref[1])
        setup_s = time.perf_counter() - t0
        for sp in sp_list:
            rows = (s // t) * b if sp else N
            case = {
                "regime": regime,
                "tp": t,
                "sp": sp,
                "world": d.world,
                "groups": d.world // t,
                "N": N,
                "s": s,
                "b": b,
                "V": V,
                "D": D,
                "V_shard": V_loc,
                "dtype": str(dtype).replace("torch.", ""),
                "seed": seed,
                "softmax": stats,
                "ref_loss": ref[0] if ref is not None else None,
                "setup_s": setup_s,
                "lower_bound_parts": {
                    "grad_e": rows * D * elem,
                    "grad_c_shard": V_loc * D * elem,
                    "gathered_e": N * D * elem if sp else 0,
                },
                "flops_per_rank": 6.0 * N * V_loc * D,
                "methods": {},
            }
            case["lower_bound_bytes"] = sum(case["lower_bound_parts"].values())
            if d.lead:
                data["cases"].append(case)
                print(
                    f"[{time.monotonic() - data['_start']:6.0f}s] TP={t} SP={'on' if sp else 'off'} {regime}: "
                    f"N={N} (s={s}, b={b}) V={V} (shard {V_loc}) D={D}; lower bound "
                    f"{C.fmt_mib(case['lower_bound_bytes'])} MiB/rank",
                    flush=True,
                )
            if sp:
                e_loc = e_sb[tp_rank * (s // t) : (tp_rank + 1) * (s // t)].clone()
                ref_ge = (
                    ref[1][lo_rows(tp_rank, s, b, t) : lo_rows(tp_rank + 1, s, b, t)]
                    if ref is not None
                    else None
                )
            else:
                e_loc = e_sb.clone()
                ref_ge = ref[1] if ref is not None else None
            x = Inputs(e_loc.requires_grad_(True), c_shard, targets, ref[0] if ref else None, ref_ge, ref_gc)
            entries, alive = {}, []
            for m in methods:
                entry = {"key": m.key, "label": m.label}
                entries[m.key] = entry
                past = deadline is not None and time.monotonic() > deadline
                if any_rank(past, d):
                    entry.update(status="skipped", error="time budget")
                elif m.unavailable:
                    entry.update(status="unavailable", error=m.unavailable)
                elif m.kind == "megatron" and mcore_ready is not True:
                    entry.update(status="error", error=f"initialize_model_parallel({t}): {mcore_ready}")
                elif m.kind == "megatron" and sp and d.device.type != "cuda":
                    entry.update(status="skipped", error="Megatron's SP linear needs CUDA (CPU smoke mode)")
                else:
                    if m.kind == "megatron":
                        buf = mcore["ps"].get_global_memory_buffer()
                        buf.buffer.clear()  # its SP all-gather buffer is counted to the method that makes it
                    t1 = time.perf_counter()

                    def builder(m=m, sp=sp):
                        return make_loss_fn(m, t, sp, D, V, group, mcore, dtype, d.device)

                    try:
                        mine, fn = measure(m, builder, x, args, d)
                    except FatalCudaError as exc:
                        # The context is gone: no more collectives. Rank 0 saves what it has; the other
                        # ranks stop at their next collective (--nccl-timeout) and torchrun ends them.
                        if d.lead:
                            entry.update(status="error", stage="?", error=f"rank 0: {exc}")
                            case["methods"][m.key] = entry
                            save()
                        raise
                    mine["wall_s"] = time.perf_counter() - t1
                    entry["_mine"] = mine
                    # Timed in rounds only where every rank has it (their collectives must meet).
                    if not any_rank(fn is None, d):
                        alive.append((mine, fn))
            t1 = time.perf_counter()
            try:
                timed_rounds(alive, x, args, d, case["flops_per_rank"])
            except FatalCudaError:
                if d.lead:  # what rank 0 measured; no collectives any more
                    for key, entry in entries.items():
                        mine = entry.pop("_mine", None)
                        if mine is not None:
                            entry.update({k: v for k, v in mine.items() if k in ("status", "stage", "error")})
                        case["methods"][key] = entry
                    save()
                raise
            for mine, _ in alive:
                mine["wall_s"] += (time.perf_counter() - t1) / len(alive)
            del alive
            for m in methods:
                entry = entries[m.key]
                mine = entry.pop("_mine", None)
                if mine is not None:
                    per_rank = gather_objects(mine, d)
                    entry.update(combine(per_rank, t))
                    entry["wall_s"] = max(r.get("wall_s", 0.0) for r in per_rank)
                if d.lead:
                    case["methods"][m.key] = entry
                    print(progress_line(case, entry), flush=True)
                    save()
            del x, e_loc
            C.free_memory(d.device)
        del e, e_sb, c_shard, targets, ref, ref_gc
        C.free_memory(d.device)


def lo_rows(r: int, s: int, b: int, t: int) -> int:
    """First flattened token row of SP rank r: e [s, b, D] rows are n = s_idx·b + b_idx."""
    return r * (s // t) * b


def progress_line(case: dict, r: dict) -> str:
    head = f"  TP={case['tp']} SP={'on ' if case['sp'] else 'off'} {r['key']:<24}"
    if "fwd_bwd" not in r:
        return f"{head} {r['status']}: {r.get('stage') or ''} {(r.get('error') or '')[:160]}"
    bits = [
        f"f+b {r['fwd_bwd']['median_ms']:8.2f} ms",
        f"{C.fmt_num(r.get('tflops'), '.0f')} TFLOP/s/rank",
        f"mem {C.fmt_mib(r.get('mem_bytes'))} MiB (bound {C.fmt_mib(case['lower_bound_bytes'])})",
        f"loss {C.fmt_err(r.get('loss_rel_err'))} dE {C.fmt_err(r.get('grad_e_rel_err'))} dC {C.fmt_err(r.get('grad_c_rel_err'))}",
        f"({r.get('wall_s', 0):.0f} s)",
    ]
    tail = "" if r["status"] == "ok" else f" [{r['status']}: {(r.get('error') or '')[:100]}]"
    return head + " " + "  ".join(bits) + tail


# ----------------------------------------------------------------------------------------------
# Reports (from the JSON alone, so --render can redo them)
# ----------------------------------------------------------------------------------------------


def _ms(r: dict | None):
    if not r or r.get("status") != "ok":
        return None
    return C.as_float((r.get("fwd_bwd") or {}).get("median_ms"))


def _index(data: dict) -> dict:
    return {(cs["regime"], cs["tp"], cs["sp"]): cs for cs in data["cases"]}


def _methods(data: dict) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for cs in data["cases"]:
        for k, r in cs["methods"].items():
            seen.setdefault(k, r.get("label", k))
    return list(seen.items())


def ratios(data: dict, case: dict, key: str, baseline: str = "megatron") -> tuple[float | None, float | None]:
    """(`baseline`'s time / this time at the same TP and SP, our TP=1 time / this time) for `key`;
    baseline: one of MEGATRON_BASELINES."""
    ms = _ms(case["methods"].get(key))
    if ms is None:
        return None, None
    mega = _ms(case["methods"].get(baseline)) if baseline != key else None
    base_case = _index(data).get((case["regime"], 1, False))
    base = _ms(base_case["methods"].get(key)) if base_case else None
    return (mega / ms if mega else None), (base / ms if base else None)


def _mem_vs_megatron(case: dict, key: str, baseline: str = "megatron"):
    """This method's memory per rank / `baseline`'s at the same TP and SP (None where either is missing)."""
    mem = C.as_float((case["methods"].get(key) or {}).get("mem_bytes"))
    mega = C.as_float((case["methods"].get(baseline) or {}).get("mem_bytes")) if baseline != key else None
    return mem / mega if mem and mega else None


def _baselines(case: dict) -> list[str]:
    """The Megatron paths measured in this case (a result from before megatron_fused was a default has none)."""
    return [k for k in MEGATRON_BASELINES if k in case["methods"]]


def evaluate_targets(data: dict) -> list[dict]:
    rows = []
    for cs in sorted(data["cases"], key=lambda x: (x["regime"], x["tp"], x["sp"])):
        for key, r in cs["methods"].items():
            if not key.startswith("ours:"):
                continue
            _, vs_tp1 = ratios(data, cs, key)
            where = {"regime": cs["regime"], "tp": cs["tp"], "sp": cs["sp"], "method": key}
            if r.get("status") != "ok":
                rows.append(
                    {
                        **where,
                        "target": "runs",
                        "value": None,
                        "threshold": None,
                        "ok": False,
                        "note": f"{r.get('status')}: {(r.get('error') or '')[:80]}",
                    }
                )
                continue
            for baseline in _baselines(cs):
                vs_mega, _ = ratios(data, cs, key, baseline)
                rows.append(
                    {
                        **where,
                        "target": f"≥{TARGET_VS_MEGATRON}× {MEGATRON_BASELINES[baseline]}",
                        "value": vs_mega,
                        "threshold": TARGET_VS_MEGATRON,
                        "ok": None if vs_mega is None else vs_mega >= TARGET_VS_MEGATRON,
                    }
                )
            if cs["tp"] == 4:
                rows.append(
                    {
                        **where,
                        "target": f"TP=4 ≥{TARGET_TP4_SCALING}× our TP=1",
                        "value": vs_tp1,
                        "threshold": TARGET_TP4_SCALING,
                        "ok": None if vs_tp1 is None else vs_tp1 >= TARGET_TP4_SCALING,
                    }
                )
            for baseline in _baselines(cs):
                mem_ratio = _mem_vs_megatron(cs, key, baseline)
                rows.append(
                    {
                        **where,
                        "target": f"memory ≤{TARGET_MEMORY_VS_MEGATRON}× {MEGATRON_BASELINES[baseline]}'s",
                        "value": mem_ratio,
                        "threshold": TARGET_MEMORY_VS_MEGATRON,
                        "ok": None if mem_ratio is None else mem_ratio <= TARGET_MEMORY_VS_MEGATRON,
                    }
                )
    return rows


def _yes(ok) -> str:
    return "–" if ok is None else ("yes" if ok else "**no**")


def render_markdown(data: dict) -> str:
    meta = data["meta"]
    cfg = meta.get("config", {})
    lines = [
        "# Loss + gradient under tensor parallelism: cce_parallel next to the Megatron path",
        "",
        (
            f"- device: {meta['world']} × {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
            f"CUDA {meta.get('cuda')}, Python {meta.get('python')}; "
            f"megatron-core {meta.get('packages', {}).get('megatron-core')}"
        ),
        f"- commit: `{meta['git_commit']}`; date: {meta['date']}",
    ]
    for cmd in meta.get("launches") or [meta.get("launch")]:
        lines.append(f"- command: `{cmd}`")
    if meta.get("sources"):
        lines.append(f"- merged from: {', '.join(meta['sources'])}")
    lines += [
        (
            f"- shape: N = {cfg.get('N')} tokens (s = {cfg.get('s')}, b = {cfg.get('b')}, [s, b, D] layout), "
            f"V = {cfg.get('V')}, D = {cfg.get('D')}, {cfg.get('dtype')}; the same global tokens at every TP size"
        ),
        (
            "- TP groups: consecutive ranks; every group runs the same work; times are TP group 0's slowest "
            f"rank, memory the largest over all {meta['world']} ranks; backend {meta.get('backend')}"
        ),
        f"- timing: {TIME_CONVENTION} (warm-up {meta.get('warmup')}, repeats {meta.get('repeats')})",
        f"- memory: {MEMORY_CONVENTION}",
        f"- FLOPs: {FLOP_CONVENTION}",
        (
            "- errors: ‖x − ref‖_F / ‖ref‖_F against an fp32 reference on the full classifier (∇e: this "
            "rank's rows under SP; ∇c: this rank's shard), largest over ranks"
        ),
        f"- env: {', '.join(f'{k}={v}' for k, v in sorted(meta.get('env', {}).items())) or 'none recorded'}",
        "",
        "Regimes:",
    ]
    for r, text in meta.get("regimes", {}).items():
        lines.append(f"- **{r}**: {text}")
    regimes = list(dict.fromkeys(cs["regime"] for cs in data["cases"]))
    for regime in regimes:
        cases = sorted(
            [cs for cs in data["cases"] if cs["regime"] == regime], key=lambda x: (x["tp"], x["sp"])
        )
        sm = cases[0].get("softmax") or {}
        lines += [
            "",
            f"## {regime}",
            "",
            (
                f"softmax entries ≥ 2^-12: {C.fmt_num(100 * (C.as_float(sm.get('frac_ge_eps')) or 0), '.4f')} % "
                f"({C.fmt_num(C.as_float(sm.get('entries_ge_eps_per_row')), '.1f')} per row) · median "
                f"p(target) {C.fmt_num(C.as_float(sm.get('p_target_median')), '.3f')} · fp32 loss "
                f"{C.fmt_num(C.as_float(cases[0].get('ref_loss')), '.4f')}"
            ),
            "",
            (
                "| TP | SP | method | fwd+bwd ms | TFLOP/s/rank | × Megatron | × Megatron fused | × own TP=1 | "
                "MiB/rank | bound MiB | × Megatron MiB | × Megatron fused MiB | loss err | ∇E err | ∇C err | status |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for cs in cases:
            for key, r in cs["methods"].items():
                ours = key.startswith("ours:")
                vs_mega, vs_tp1 = ratios(data, cs, key)
                vs_fused, _ = ratios(data, cs, key, "megatron_fused")
                mem = C.as_float(r.get("mem_bytes"))
                mem_ratio = _mem_vs_megatron(cs, key) if ours else None
                mem_fused = _mem_vs_megatron(cs, key, "megatron_fused") if ours else None
                status = r.get("status", "?")
                if status != "ok":
                    status = " ".join(
                        x for x in (f"{status}:", r.get("stage"), (r.get("error") or "")[:90]) if x
                    )
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            str(cs["tp"]),
                            "on" if cs["sp"] else "off",
                            r.get("label", key),
                            C.fmt_num(
                                _ms(r)
                                if status == "ok"
                                else C.as_float((r.get("fwd_bwd") or {}).get("median_ms")),
                                ".2f",
                            ),
                            C.fmt_num(C.as_float(r.get("tflops")), ".0f"),
                            C.fmt_num(vs_mega, ".2f") if ours else "",
                            C.fmt_num(vs_fused, ".2f") if ours else "",
                            C.fmt_num(vs_tp1, ".2f"),
                            C.fmt_mib(mem),
                            C.fmt_mib(cs["lower_bound_bytes"]),
                            C.fmt_num(mem_ratio, ".2f"),
                            C.fmt_num(mem_fused, ".2f"),
                            C.fmt_err(C.as_float(r.get("loss_rel_err"))),
                            C.fmt_err(C.as_float(r.get("grad_e_rel_err"))),
                            C.fmt_err(C.as_float(r.get("grad_c_rel_err"))),
                            status.replace("|", "/"),
                        ]
                    )
                    + " |"
                )
    targets = evaluate_targets(data)
    lines += ["", "## Targets (issue)", ""]
    if targets:
        lines += [
            "| regime | TP | SP | method | target | measured | threshold | met |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t in targets:
            val = t["value"]
            meas = t.get("note") or (
                C.fmt_num(val, ".2f")
                if val is not None
                else "–"
            )
            thr = C.fmt_num(t["threshold"], ".2f") if t["threshold"] is not None else "–"
            lines.append(
                f"| {t['regime']} | {t['tp']} | {'on' if t['sp'] else 'off'} | {t['method']} | {t['target']} | "
                f"{meas} | {thr} | {_yes(t['ok'])} |"
            )
        met = [t for t in targets if t["ok"] is True]
        failed = [t for t in targets if t["ok"] is False]
        lines += [
            "",
            f"{len(met)} met, {len(failed)} missed, {len(targets) - len(met) - len(failed)} not measurable.",
        ]
    lines += [
        "",
        "The issue's own Megatron measurements (4×H200, NVLink, N = 8,192), next to ours of the same path:",
        "",
        "| TP | issue ms | issue GB | measured ms (SP off) | measured GB/rank (SP off) |",
        "|---|---|---|---|---|",
    ]
    idx = _index(data)
    for tp, (ms, gb) in ISSUE_MEGATRON.items():
        cs = idx.get((regimes[0], tp, False)) if regimes else None
        r = cs["methods"].get("megatron") if cs else None
        mem = C.as_float(r.get("mem_bytes")) if r else None
        lines.append(
            f"| {tp} | {ms} | {gb} | {C.fmt_num(_ms(r), '.2f')} | {C.fmt_num(mem / 1e9 if mem else None, '.2f')} |"
        )
    if data.get("aborted"):
        lines += ["", f"**Run aborted:** {data['aborted']}"]
    if data.get("failures"):
        lines += ["", "**Failures:**"] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


def render_compact(data: dict) -> str:
    out = []
    for cs in sorted(data["cases"], key=lambda x: (x["regime"], x["tp"], x["sp"])):
        for key, r in cs["methods"].items():
            vs_mega, vs_tp1 = ratios(data, cs, key)
            vs_fused, _ = ratios(data, cs, key, "megatron_fused")
            mem = C.as_float(r.get("mem_bytes"))
            out.append(
                f"{cs['regime']:<7} TP={cs['tp']} SP={'on ' if cs['sp'] else 'off'} {key:<24} "
                f"{C.fmt_num(_ms(r), '.2f'):>8} ms  x{C.fmt_num(vs_mega, '.2f'):>5} mega  "
                f"x{C.fmt_num(vs_fused, '.2f'):>5} fused  "
                f"x{C.fmt_num(vs_tp1, '.2f'):>5} tp1  {C.fmt_mib(mem):>7} MiB (bound {C.fmt_mib(cs['lower_bound_bytes'])})  "
                f"{r.get('status')}"
            )
    return "\n".join(out)


def write_outputs(data: dict, stem: Path) -> list[str]:
    clean = {k: v for k, v in data.items() if not k.startswith("_")}
    C.write_json(stem.with_suffix(".json"), clean)
    stem.with_suffix(".md").write_text(render_markdown(clean))
    return [str(stem.with_suffix(".json")), str(stem.with_suffix(".md"))]


def stem_for(out_dir: Path, meta: dict, tag: str | None) -> Path:
    return C.out_stem(out_dir, meta, "tp" + (f"_{tag}" if tag else ""))


def render_only(args) -> int:
    datas = [json.loads(Path(f).read_text()) for f in args.render]
    meta = dict(datas[0]["meta"])
    meta["sources"] = [Path(f).name for f in args.render]
    meta["launches"] = list(dict.fromkeys(d["meta"].get("launch") for d in datas if d["meta"].get("launch")))
    meta["tp_sizes"] = sorted({t for d in datas for t in d["meta"].get("tp_sizes", [])})
    index: dict = {}
    for d in datas:  # later files win for the same (regime, tp, sp)
        for cs in d["cases"]:
            index[(cs["regime"], cs["tp"], cs["sp"])] = cs
    merged = {"meta": meta, "cases": list(index.values())}
    fails = [f for d in datas for f in d.get("failures", [])]
    if fails:
        merged["failures"] = fails
    aborted = [d["aborted"] for d in datas if d.get("aborted")]
    if aborted:
        merged["aborted"] = "; ".join(aborted)
    out_dir = Path(args.out) if args.out else Path(args.render[0]).parent
    stem = stem_for(out_dir, meta, args.tag)
    written = write_outputs(merged, stem)
    print(render_compact(merged))
    print("[bench_tp] wrote " + ", ".join(written))
    return 0


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            "Example: torchrun --nproc_per_node 4 benchmarks/bench_tp.py --tp 1,2,4 --out $OUT --commit SHA; "
            "benchmarks/run_bench_tp.sh runs one launch per TP size and merges them with --render."
        ),
    )
    p.add_argument("--tp", default="1,2,4", help="comma list of TP sizes; each must divide the world size")
    p.add_argument(
        "--sp", default="off,on", help="sequence parallelism: off, on or off,on (on only for TP > 1)"
    )
    p.add_argument("--shape", default="gemma2-2b", help=f"head (V, D): one of {', '.join(C.MODEL_SHAPES)}")
    p.add_argument("--vocab", type=int, default=None, help="V (overrides --shape)")
    p.add_argument("--hidden", type=int, default=None, help="D (overrides --shape)")
    p.add_argument("--seq", type=int, default=4096, help="s: sequence length (global); N = s·b")
    p.add_argument("--batch", type=int, default=2, help="b: micro-batch size")
    p.add_argument("--regimes", default="random", help=f"comma list from {', '.join(C.REGIMES)}")
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma list: megatron, megatron_fused, ours (every Triton impl), ours:<impl>",
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed calls before timing (after the accuracy call)"
    )
    p.add_argument("--repeats", type=int, default=10, help="timed calls; the median is reported")
    p.add_argument(
        "--rounds", type=int, default=5,
        help="forward + backward is timed in this many rounds over all methods, --repeats calls per method in all",
    )
    p.add_argument("--fwd", action="store_true", help="also time the forward alone")
    p.add_argument("--no-errors", action="store_true", help="skip the fp32 reference and the error columns")
    p.add_argument("--stats-rows", type=int, default=1024, help="rows sampled for the softmax statistics")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; start no new method after this")
    p.add_argument(
        "--nccl-timeout", type=float, default=120.0, help="seconds before a stuck collective fails"
    )
    p.add_argument(
        "--out", default=None, help="output folder (default benchmarks/results; /tmp/... with --cpu-smoke)"
    )
    p.add_argument("--tag", default=None, help="suffix of the output names: <gpu>_<yyyymmdd>_tp_<tag>")
    p.add_argument("--commit", default=None, help="commit to record (where the tree has no .git)")
    p.add_argument(
        "--cpu-smoke",
        "--dry-run",
        dest="cpu_smoke",
        action="store_true",
        help="tiny shapes on CPU with gloo, impl 'torch' for ours: tests the plumbing, measures nothing",
    )
    p.add_argument(
        "--render", nargs="+", metavar="JSON", default=None, help="no measuring: merge these results"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Megatron's advice, printed once per rank; the setting is recorded in meta.env instead.
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    if args.render:
        return render_only(args)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.cpu_smoke:
        if args.shape == "gemma2-2b" and args.vocab is None:
            args.vocab, args.hidden = C.SMOKE_SHAPES["tiny-b"]
        if args.seq == 4096:
            args.seq = 16
        if args.methods == DEFAULT_METHODS:
            args.methods = SMOKE_METHODS
        if args.warmup == 3:
            args.warmup = 1
        if args.repeats == 10:
            args.repeats = 3
        if args.stats_rows == 1024:
            args.stats_rows = 32
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
    args.rounds = max(1, min(args.rounds, args.repeats))
    if args.shape not in C.MODEL_SHAPES and args.vocab is None:
        raise SystemExit(
            f"unknown --shape {args.shape!r}; known: {', '.join(C.MODEL_SHAPES)} (or --vocab/--hidden)"
        )
    V0, D0 = C.MODEL_SHAPES.get(args.shape, (None, None))
    V, D = args.vocab or V0, args.hidden or D0
    shape = C.Shape(args.shape if args.vocab is None else f"V{V}", args.seq * args.batch, V, D)
    args.regimes = C.csv_list(args.regimes)
    for r in args.regimes:
        if r not in C.REGIMES:
            raise SystemExit(f"unknown regime {r!r}; known: {', '.join(C.REGIMES)}")
    sp_words = C.csv_list(args.sp)
    if not sp_words or any(w not in ("off", "on") for w in sp_words):
        raise SystemExit("--sp takes off, on or off,on")
    args.sp_list = [w == "on" for w in dict.fromkeys(sp_words)]
    tp_sizes = [int(x) for x in C.csv_list(args.tp)]

    d = init_dist(args.cpu_smoke, args.nccl_timeout)
    if args.cpu_smoke and args.tp == "1,2,4":
        tp_sizes = [t for t in tp_sizes if d.world % t == 0]
    bad = [
        t
        for t in tp_sizes
        if t < 1 or d.world % t or V % t or (True in args.sp_list and t > 1 and args.seq % t)
    ]
    if bad:
        print(
            f"[bench_tp rank {d.rank}] TP sizes {bad} must divide the world ({d.world}), V ({V}) and, with SP, "
            f"s ({args.seq})",
            file=sys.stderr,
            flush=True,
        )
        dist.destroy_process_group()
        return 2

    mcore, mcore_err = import_megatron()
    methods = build_methods(C.csv_list(args.methods), mcore, mcore_err)
    meta = C.run_metadata(d.device, args.commit)
    script_args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta.update(
        {
            "world": d.world,
            "backend": d.backend,
            "launch": f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', d.world)} "
            f"benchmarks/bench_tp.py {script_args}".strip(),
            "tp_sizes": tp_sizes,
            "sp": args.sp_list,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "config": {
                "N": shape.N,
                "s": args.seq,
                "b": args.batch,
                "V": V,
                "D": D,
                "dtype": args.dtype,
                "shape": args.shape,
            },
            "regimes": {r: C.REGIMES[r] for r in args.regimes},
            "time_convention": TIME_CONVENTION,
            "memory_convention": MEMORY_CONVENTION,
            "flop_convention": FLOP_CONVENTION,
            "issue_megatron_ms_gb": {str(k): v for k, v in ISSUE_MEGATRON.items()},
            "methods": {m.key: {"label": m.label, "unavailable": m.unavailable, **m.info} for m in methods},
            "packages": {n: C.pkg_version(n) for n in ("megatron-core", "cce-parallel", "numpy")},
        }
    )
    meta["env"].update(
        {
            k: v
            for k, v in os.environ.items()
            if k.startswith("NCCL_")
            or k in ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
        }
    )
    out_dir = (
        Path(args.out)
        if args.out
        else (
            Path("/tmp/cce_parallel_bench_smoke")
            if args.cpu_smoke
            else C.REPO_ROOT / "benchmarks" / "results"
        )
    )
    data: dict = {"meta": meta, "cases": [], "_start": time.monotonic()}
    stem = stem_for(out_dir, meta, args.tag)

    def save():
        if d.lead:
            data["elapsed_s"] = time.monotonic() - data["_start"]
            write_outputs(data, stem)

    if d.lead:
        print(
            f"[bench_tp] {d.world} × {meta['device']} ({d.backend}) | torch {meta['torch']} | triton {meta['triton']} | "
            f"megatron-core {meta['packages']['megatron-core']} | commit {meta['git_commit']}",
            flush=True,
        )
        for m in methods:
            print(
                f"[bench_tp] method {m.key:<24} {m.label}"
                + (f"  UNAVAILABLE: {m.unavailable}" if m.unavailable else ""),
                flush=True,
            )
        print(
            f"[bench_tp] TP {tp_sizes}, SP {args.sp}, regimes {args.regimes} -> {stem}.{{json,md}}",
            flush=True,
        )

    deadline = data["_start"] + args.time_budget if args.time_budget else None
    rc = 0
    try:
        for t in tp_sizes:
            run_tp(t, d, args, methods, mcore, dtype, shape, data, save, deadline)
    except FatalCudaError as exc:
        data["aborted"] = f"fatal CUDA error on rank {d.rank}, run stopped: {exc}"
        print(f"[bench_tp] {data['aborted']}", file=sys.stderr, flush=True)
        rc = 3
    except Exception as exc:  # noqa: BLE001 - keep what was measured, then fail loudly
        traceback.print_exc()
        data["aborted"] = f"unexpected error on rank {d.rank}, run stopped: {C.short_error(exc)}"
        rc = 4

    if d.lead:
        expected_skip = ("unavailable", "skipped") if args.cpu_smoke else ("skipped",)
        fails = [
            f"TP={cs['tp']} SP={'on' if cs['sp'] else 'off'} {cs['regime']} {k}: {r.get('status')} "
            f"{r.get('stage') or ''} {(r.get('error') or '')[:200]}".replace("  ", " ")
            for cs in data["cases"]
            for k, r in cs["methods"].items()
            if r.get("status") != "ok" and not (r.get("status") in expected_skip)
        ]
        if fails:
            data["failures"] = fails
        skipped = sum(r.get("status") == "skipped" for cs in data["cases"] for r in cs["methods"].values())
        if skipped:
            print(f"[bench_tp] {skipped} method runs skipped (time budget or CPU smoke mode)", flush=True)
        save()
        print(render_compact(data))
        print(f"[bench_tp] {data['elapsed_s']:.0f} s; wrote {stem}.json, {stem}.md", flush=True)
        if fails:
            print("[bench_tp] FAILURES:\n  " + "\n  ".join(fails), file=sys.stderr, flush=True)
            rc = rc or 1
    if rc == 0 or rc == 1:
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - shutting down anyway
            pass
    return rc


if __name__ == "__main__":
    sys.exit(main())
