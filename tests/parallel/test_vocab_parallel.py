"""Vocab-parallel (tensor-parallel) and sequence-parallel linear_cross_entropy across processes.

On CPU each world size (1, 2, 3, 4) gets ONE gloo process group (tests/dist.py; spawning a process
that imports torch costs seconds), and its workers loop over shard layouts x cases x impls. Every
rank builds the same seeded full inputs, takes its shard (classifier rows [start, stop) and bias
slice; with sequence_parallel also its rows of e along dim 0) and runs
``linear_cross_entropy(..., tp_group=WORLD, vocab_range=..., sequence_parallel=...)``. It compares
with the float64 oracle of tests/oracle.py on the FULL classifier: loss and lse as they are, ∇e
whole (with sequence_parallel: this rank's rows of it), ∇c and ∇bias rows [start, stop).
Tolerances are those of tests/ops/test_numerics_cpu.py, and like there a gradient's error is
relative to the norm of the whole gradient, also for a rank's shard (see shard_errors). Besides:
- every rank must return bit-identical loss and lse, and without sequence_parallel a bit-identical
  ∇e (TP replicas of the backbone that get different gradients drift apart);
- impl "exact" must be bit-identical across two runs;
- bad shard layouts and ranks that disagree on shapes raise ValueError on EVERY rank, not a hang;
- so do targets outside the vocabulary on ONE rank only, on every path of the forward.

The Triton impls run under the Triton interpreter (TRITON_INTERPRET=1 from tests/conftest.py,
inherited by the spawned processes). With CCE_TEST_GPU=1 the small cases run on CUDA through
NCCL where there is a GPU per rank (else only impl "torch", on CPU). test_gpu_bf16_real_shape runs
bf16 at a Llama-3 shape on 2 and 4 GPUs against a single-GPU run of the same impl.

A failing test lists the failing checks, "<layout>/<case>/<impl> (ranks [...])", grouped by message
(numbers aside), with the first message of each group; `pytest -s` also prints the time per layout
and the largest measured errors per impl.
"""

import dataclasses
import functools
import itertools
import math
import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import cce_parallel
from tests.dist import spawn
from tests.helpers import check_meta, errors, gpu_run, peaked_inputs, random_inputs, run, upstream
from tests.oracle import Outputs, oracle

pytestmark = pytest.mark.distributed

D = 48
V_ODD = 517  # with explicit, uneven vocab_range shards
V_EVEN = 516  # default equal shards: divisible by 1, 2, 3 and 4
SP_LEAD = (12, 3)  # [s, b] as in Megatron; s divisible by every world size tested
TIGHT = {"loss": 1e-5, "lse": 1e-5, "de": 5e-5, "dc": 5e-5, "dbias": 5e-5}
GROUP_TIMEOUT_S = {"gloo": 420.0, "nccl": 900.0}  # NCCL: first use may compile every Triton kernel
# "cce" (dC summed in bf16 on the one-pass path) and "cce_kahan_full_c" (in fp32, as every other
# Triton impl, identically) stand for the Triton impls; "torch" is the PyTorch path.
TESTED_IMPLS = ("cce_kahan_full_c", "torch")  # every Triton impl computes the same (tests/ops)


def fp32_tol(impl, options=None):
    return TIGHT


# ---------------------------------------------------------------------------------------------
# Layouts (how the vocabulary is sharded) and cases (inputs + options)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    vocab: int
    ranges: tuple | None  # per-rank (start, stop) passed as vocab_range; None: default shards
    sequence_parallel: bool
    cases: tuple = ()  # names of the cases run with every impl
    torch_only: tuple = ()  # names of the cases run with impl "torch" only

    def shard(self, rank: int, world: int) -> tuple:
        if self.ranges is not None:
            return self.ranges[rank]
        assert self.vocab % world == 0
        size = self.vocab // world
        return rank * size, (rank + 1) * size

    def vocab_range(self, rank: int):
        return None if self.ranges is None else self.ranges[rank]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lead: tuple = (37,)  # token shape without sequence_parallel; with it, SP_LEAD (or sp_lead)
    sp_lead: tuple = SP_LEAD
    bias: bool = False
    logit_std: float = 2.0
    ignore_frac: float = 0.0
    targets_on_rank0: bool = False  # every target in rank 0's shard: other shards hold none
    peaked: bool = False  # trained-model-like logits (helpers.peaked_inputs)
    uniform: bool = False  # reduction "none": one upstream number over the kept tokens (mask / count)
    masked: float = 0.0  # with uniform, this fraction of the tokens gets 0 too (the mask not folded)
    # A bias of 45 on the vocabulary's first half and 42 on the rest: each row's logits lie on both
    # sides of the fused GEMM's reference boundary at 44.4 nats, between tiles and between ranks.
    straddle: bool = False
    weights: str = ""  # per-token weights given in the forward: "signed" (RL advantages) or "mask" (0 / 1)
    deferred: bool = False  # as for a loss whose state saw weights only in a backward: dC made in the backward
    options: tuple = ()  # (key, value) pairs of linear_cross_entropy options

    @property
    def opts(self) -> dict:
        return dict(self.options)

    def inputs(self, layout: Layout, world: int, device) -> dict:
        """Full inputs, the same on every rank (seeded)."""
        lead = self.sp_lead if layout.sequence_parallel else self.lead
        ignore_index = self.opts.get("ignore_index", -100)
        if self.peaked:
            return peaked_inputs(lead, layout.vocab, D, device=device, n_head=16, n_mid=128, n_rare=3)
        inputs = random_inputs(
            lead,
            layout.vocab,
            D,
            device=device,
            seed=7,
            logit_std=self.logit_std,
            bias=self.bias,
            ignore_frac=self.ignore_frac,
            ignore_index=ignore_index,
        )
        if self.straddle:
            rows = torch.arange(layout.vocab, device=inputs["bias"].device)
            inputs["bias"] = torch.where(rows < layout.vocab // 2, 45.0, 42.0) + 0.1 * inputs["bias"]
        if self.targets_on_rank0:
            start, stop = layout.shard(0, world)
            t = inputs["targets"]
            inputs["targets"] = torch.where(t == ignore_index, t, start + t % (stop - start))
        return inputs

    def weights_for(self, targets):
        """The forward's per-token weights (seeded, the same on every rank), or None."""
        if not self.weights:
            return None
        g = torch.Generator().manual_seed(13)
        w = torch.randn(targets.shape, generator=g)
        return (w > -1.2).float().to(targets.device) if self.weights == "mask" else w.to(targets.device)


CASES = {
    case.name: case
    for case in [
        Case("mean", options=(("reduction", "mean"),)),
        Case(
            "bias-softcap-none",
            bias=True,
            logit_std=20.0,
            options=(("softcap", 20.0), ("temperature", 0.7), ("reduction", "none")),
        ),
        Case(
            "smoothing-zloss-ignored-sum",
            ignore_frac=0.3,
            options=(("label_smoothing", 0.1), ("z_loss", 1e-2), ("reduction", "sum")),
        ),
        Case(
            "lse-ignore-in-vocab",
            lead=(2, 19),
            ignore_frac=0.25,
            options=(("ignore_index", 3), ("z_loss", 1e-3), ("reduction", "none"), ("return_lse", True)),
        ),
        Case(
            "everything",
            lead=(2, 19),
            bias=True,
            logit_std=20.0,
            ignore_frac=0.2,
            options=(
                ("ignore_index", -1),
                ("softcap", 20.0),
                ("temperature", 1.5),
                ("label_smoothing", 0.1),
                ("z_loss", 1e-3),
                ("reduction", "mean"),
                ("return_lse", True),
            ),
        ),
        Case(
            "targets-on-rank0",
            bias=True,
            ignore_frac=0.1,
            targets_on_rank0=True,
            options=(("label_smoothing", 0.1), ("reduction", "none"), ("return_lse", True)),
        ),
        # Trained-model-like: the head ids sit in rank 0's shard, the tail elsewhere; Megatron's
        # upstream gradient (one number over the kept tokens), the one-pass path in token blocks
        # of 3 tokens, and the lean path.
        Case(
            "peaked-masked-blocks",
            lead=(64,),
            peaked=True,
            uniform=True,
            options=(("reduction", "none"), ("logits_budget", 3 * 4 * V_ODD)),
        ),
        # Megatron's loss_mask / count with the mask not folded into ignore_index: one number on
        # most kept tokens, 0 on about a quarter; each rank subtracts its shard's masked rows.
        Case(
            "masked-unfolded",
            bias=True,
            ignore_frac=0.1,
            uniform=True,
            masked=0.25,
            options=(("z_loss", 1e-3), ("reduction", "none")),
        ),
        Case(
            "peaked-lean",
            lead=(64,),
            peaked=True,
            options=(("reduction", "none"), ("return_lse", True), ("logits_budget", "lean")),
        ),
        Case(
            "straddle",
            bias=True,
            logit_std=0.5,
            straddle=True,
            options=(("reduction", "mean"),),
        ),
        Case("all-ignored-sum", ignore_frac=1.0, options=(("reduction", "sum"), ("return_lse", True))),
        Case("all-ignored-mean", ignore_frac=1.0, bias=True, options=(("reduction", "mean"),)),
        # Per-token weights known in the forward, folded into the one-pass gradients: signed (RL
        # advantages) under a mean over their sum, and a 0 / 1 mask under Megatron's upstream.
        Case(
            "weights-signed-mean",
            bias=True,
            ignore_frac=0.2,
            weights="signed",
            options=(("z_loss", 1e-3), ("reduction", "mean"), ("return_lse", True)),
        ),
        Case(
            "weights-mask-none",
            ignore_frac=0.1,
            logit_std=20.0,
            uniform=True,
            weights="mask",
            options=(("softcap", 20.0), ("reduction", "none"), ("logits_budget", 3 * 4 * V_ODD)),
        ),
        # Random per-token weights only in the backward, for a loss whose state has seen such
        # weights: dE made in the forward, dC and dbias in one more pass (with its all-reduces) in
        # the backward.
        Case(
            "deferred-weighted",
            bias=True,
            ignore_frac=0.2,
            deferred=True,
            options=(("label_smoothing", 0.1), ("reduction", "none"), ("logits_budget", 3 * 4 * V_ODD)),
        ),
        Case(
            "sp-2d-e",  # e [s, D] rather than [s, b, D]
            sp_lead=(12,),
            ignore_frac=0.2,
            options=(("z_loss", 1e-3), ("reduction", "none"), ("return_lse", True)),
        ),
    ]
}
WEIGHTS = ("weights-signed-mean", "weights-mask-none", "deferred-weighted")
CORE = tuple(name for name in CASES if name not in ("sp-2d-e", "straddle", "masked-unfolded") + WEIGHTS)

# impl "torch" (cheap) over the full option grid, as in test_numerics_cpu.test_torch_impl_full_grid.
GRID = {}
for _bias, _softcap, _ls, _z, _ign, _lse, _red in itertools.product(
    [False, True], [None, 20.0], [0.0, 0.1], [0.0, 5e-3], [0.0, 0.3], [False, True], ["none", "sum", "mean"]
):
    _case = Case(
        f"grid-b{int(_bias)}-sc{_softcap}-ls{_ls}-z{_z}-ig{_ign}-lse{int(_lse)}-{_red}",
        lead=(2, 19) if _lse else (37,),
        bias=_bias,
        logit_std=20.0 if _softcap else 2.0,
        ignore_frac=_ign,
        options=(
            ("softcap", _softcap),
            ("label_smoothing", _ls),
            ("z_loss", _z),
            ("reduction", _red),
            ("return_lse", _lse),
        ),
    )
    GRID[_case.name] = _case
ALL_CASES = {**CASES, **GRID}

UNEVEN3 = ((0, 100), (100, 400), (400, 517))
TINY2 = ((0, 17), (17, V_ODD))  # rank 0's shard is smaller than one vocabulary block
SP_CORE = CORE + ("sp-2d-e",)


def _rest(*names):
    """The CORE cases not named."""
    return tuple(n for n in CORE if n not in names)


# Every impl gets every CORE case in the main layout of each world size, with and without sequence
# parallelism (at world size 1, with it, a few; "torch" the rest); impl "torch" also gets the full
# option grid (`torch_only`) with uneven shards, once with and once without sequence parallelism.
LAYOUTS = {
    1: (
        Layout("w1-default", V_ODD, None, False, CORE + ("straddle",)),
        Layout("w1-explicit-range", V_ODD, ((0, V_ODD),), False, ("everything",)),
        Layout(
            "w1-sp", V_ODD, None, True, ("everything", "peaked-masked-blocks", "sp-2d-e"), _rest("everything")
        ),
    ),
    2: (
        Layout("w2-default", V_EVEN, None, False, CORE + ("straddle", "masked-unfolded") + WEIGHTS),
        Layout("w2-tiny-first-shard", V_ODD, TINY2, False, ("everything", "targets-on-rank0") + WEIGHTS),
        Layout(
            "w2-swapped-ranges", V_ODD, ((300, V_ODD), (0, 300)), False, ("everything", "targets-on-rank0")
        ),
        Layout("w2-sp", V_EVEN, None, True, SP_CORE + ("masked-unfolded",)),
        Layout("w2-sp-uneven", V_ODD, TINY2, True, ("everything",) + WEIGHTS, tuple(GRID)),
    ),
    3: (
        Layout("w3-uneven", V_ODD, UNEVEN3, False, CORE + ("straddle",), tuple(GRID)),
        Layout("w3-default", V_EVEN, None, False, ("everything", "lse-ignore-in-vocab")),
        Layout("w3-uneven-sp", V_ODD, UNEVEN3, True, SP_CORE),
    ),
    4: (
        Layout("w4-default", V_EVEN, None, False, CORE),
        Layout("w4-sp", V_EVEN, None, True, SP_CORE),
    ),
}


def planned_checks(layout: Layout, impls: tuple) -> list:
    """(check name, case, impl) for a layout, in run order."""
    out = []
    for case_names, case_impls in ((layout.cases, impls), (layout.torch_only, ("torch",))):
        for case_name in case_names:
            for impl in case_impls:
                if impl in impls:
                    out.append((f"{layout.name}/{case_name}/{impl}", ALL_CASES[case_name], impl))
    return out


def small_setup(world: int):
    """(backend, device type, impls) for the small fp32 cases."""
    if gpu_run():
        if torch.cuda.device_count() >= world:
            return "nccl", "cuda", TESTED_IMPLS
        return "gloo", "cpu", ("torch",)  # no interpreter with CCE_TEST_GPU=1: Triton impls fall back
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "gloo", "cpu", ("torch",)
    return "gloo", "cpu", TESTED_IMPLS


# ---------------------------------------------------------------------------------------------
# Worker side (runs in the spawned processes)


def too_large(errs: dict, tol, against: str) -> str | None:
    """None if every relative error is within tolerance, else a message naming the bad ones."""
    limit = {k: tol[k] if isinstance(tol, dict) else tol for k in errs}
    bad = [f"{k}={v:.2e} (tol {limit[k]:.0e})" for k, v in errs.items() if not v <= limit[k]]
    if not bad:
        return None
    shown = ", ".join(f"{k}={v:.1e}" for k, v in errs.items())
    return f"relative error vs {against} too large: {', '.join(bad)}; all: {shown}"


def shard_errors(out: Outputs, expected: Outputs, ref: Outputs) -> dict:
    """Relative errors, with those of ∇e/∇c/∇bias shards taken relative to the FULL reference norm.

    That is how the single-process tests measure them (relative to the whole ∇C). Relative to its
    own norm, a shard holding only the softmax tail (gradient ~1e-11 of the whole in the peaked
    cases) would count the tail that filtering legitimately drops, or exact's fixed-point rounding,
    as a 100% error.
    """
    errs = errors(out, expected)
    for name in ("de", "dc", "dbias"):
        if name not in errs or not math.isfinite(errs[name]):
            continue
        shard_norm = float(torch.linalg.vector_norm(getattr(expected, name).double()))
        full_norm = float(torch.linalg.vector_norm(getattr(ref, name).double()))
        if full_norm > 0:
            errs[name] *= (shard_norm if shard_norm > 0 else 1.0) / full_norm
    return errs


def same_bits(a, b) -> bool:
    """Equal values, shape and dtype; NaN equals NaN."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _describe(exc: BaseException) -> str:
    if isinstance(exc, AssertionError):
        return str(exc)
    # The frames in cce_parallel, and the last one.
    frames = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in frames if "cce_parallel" in f.filename and "/tests/" not in f.filename]
    if frames and (not keep or keep[-1] is not frames[-1]):
        keep.append(frames[-1])
    where = "".join(f"\n  at {f.filename}:{f.lineno} in {f.name}: {f.line}" for f in keep[-6:])
    return f"{type(exc).__name__}: {exc}{where}"


def tp_call(group, layout: Layout, rank: int):
    return functools.partial(
        cce_parallel.linear_cross_entropy,
        tp_group=group,
        vocab_range=layout.vocab_range(rank),
        sequence_parallel=layout.sequence_parallel,
    )


def local_view(inputs: dict, layout: Layout, rank: int, world: int):
    """This rank's inputs and the (row start, row stop) of e it holds (all rows without SP)."""
    start, stop = layout.shard(rank, world)
    e = inputs["e"]
    rows = (0, e.shape[0])
    if layout.sequence_parallel:
        s = e.shape[0] // world
        rows = (rank * s, (rank + 1) * s)
    local = {
        "e": e[rows[0] : rows[1]],
        "c": inputs["c"][start:stop],
        "targets": inputs["targets"],
        "bias": None if inputs["bias"] is None else inputs["bias"][start:stop],
    }
    return local, rows


def expected_shard(ref: Outputs, layout: Layout, rank: int, world: int, rows) -> Outputs:
    start, stop = layout.shard(rank, world)
    return Outputs(
        loss=ref.loss,
        lse=ref.lse,
        de=ref.de[rows[0] : rows[1]],
        dc=ref.dc[start:stop],
        dbias=None if ref.dbias is None else ref.dbias[start:stop],
    )


def _ranks_agree(out, sequence_parallel: bool, group):
    """(all ranks ran, message): every rank's loss, lse (and ∇e without SP) must be bit-identical.

    Every rank calls this after every check, whatever happened, so that the ranks stay in step.
    """
    mine = None
    if out is not None:
        mine = {"loss": out.loss.cpu(), "lse": None if out.lse is None else out.lse.cpu()}
        if not sequence_parallel:
            mine["de"] = out.de.cpu()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if any(g is None for g in gathered):
        return False, None  # some rank failed already; that failure is reported
    bad = []
    for key in gathered[0]:
        differ = [r for r, g in enumerate(gathered) if not same_bits(g[key], gathered[0][key])]
        if differ:
            bad.append(f"{key} of ranks {differ} differs from rank 0's")
    return True, "; ".join(bad) or None


def _numerics_worker(rank, world, report, layout_names, device_type, impls):
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    layouts = {layout.name: layout for layout in LAYOUTS[world]}
    for layout_name in layout_names:
        began = time.perf_counter()
        layout = layouts[layout_name]
        fn = tp_call(group, layout, rank)
        by_case = {}
        for name, case, impl in planned_checks(layout, impls):
            by_case.setdefault(case.name, (case, []))[1].append((name, impl))
        for case, checks in by_case.values():
            inputs = case.inputs(layout, world, device)
            opts = case.opts
            grad_loss, grad_lse = upstream(
                inputs["targets"], opts.get("reduction", "mean"), opts.get("return_lse"), uniform=case.uniform,
                ignore_index=opts.get("ignore_index", -100), masked=case.masked,
            )
            weights = case.weights_for(inputs["targets"])
            if weights is not None:
                opts = dict(opts, weights=weights)
            ref = oracle(**inputs, grad_loss=grad_loss, grad_lse=grad_lse, **opts)
            local, rows = local_view(inputs, layout, rank, world)
            # A mask not folded: as for a loss whose state has seen one (the first call's recompute
            # is the device's), so that the correction on the masked rows runs, on every rank alike;
            # and one with 3 masked rows, so that 3 are taken out before the host sync, the rest after.
            call = fn
            if case.masked or case.deferred:
                state = cce_parallel.UpstreamState()
                state.masked_weights_seen, state.per_token_weights_seen = bool(case.masked), case.deferred
                state.masked_rows = 3 if case.masked else 0
                call = functools.partial(fn, state=state)
            expected = expected_shard(ref, layout, rank, world, rows)
            for name, impl in checks:
                report.started(name)
                options = dict(opts, impl=impl)
                out, errs, fail = None, {}, None
                try:
                    deferred = state.paths["deferred"] if case.deferred else 0
                    out = run(call, local, options, grad_loss, grad_lse)
                    check_meta(out, local, options)
                    errs = shard_errors(out, expected, ref)
                    tol = fp32_tol(impl, options)
                    fail = too_large(errs, tol, "float64 oracle")
                    if case.deferred and impl != "torch" and state.paths["deferred"] != deferred + 1:
                        fail = fail or f"the backward did not defer dC (paths {dict(state.paths)})"
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    out, fail = None, _describe(exc)
                all_ran, disagree = _ranks_agree(out, layout.sequence_parallel, group)
                if disagree and fail is None:
                    fail = "ranks disagree: " + disagree
                if impl == "exact" and all_ran:  # on every rank or none: the rerun has collectives
                    try:
                        again = run(call, local, options, grad_loss, grad_lse)
                        differ = [k for k, a, b in zip(out._fields, out, again) if not same_bits(a, b)]
                        if differ and fail is None:
                            fail = f"impl 'exact' with tp_group is not bitwise reproducible in {differ}"
                    except Exception as exc:  # noqa: BLE001
                        fail = fail or "rerun: " + _describe(exc)
                report.result(name, {"fail": fail, "errs": errs})
        report.result(f"seconds/{layout_name}", time.perf_counter() - began)


# ---------------------------------------------------------------------------------------------
# Parent side: one process group per world size, shared by the tests of that world size


@functools.cache
def numerics_group(world: int):
    backend, device_type, impls = small_setup(world)
    layout_names = tuple(layout.name for layout in LAYOUTS[world])
    outcome = spawn(
        _numerics_worker,
        world,
        (layout_names, device_type, impls),
        backend=backend,
        timeout=GROUP_TIMEOUT_S[backend],
        collective_timeout=120.0,
    )
    times = ", ".join(f"{k[8:]} {v:.0f} s" for k, v in outcome.results(0).items() if k.startswith("seconds/"))
    print(f"\n[world {world}] {backend}: process group ran {outcome.seconds:.1f} s ({times})")
    return outcome, impls


def summarize_failures(outcome, names: list, limit: int = 30) -> list:
    """Failing or missing checks (any rank), grouped by message: one entry per distinct message."""
    merged = outcome.merged()
    by_msg = {}  # message with numbers blanked -> (first message, ["check (ranks)", ...])
    for name in names:
        per_rank = merged.get(name)
        if per_rank is None:
            msg = "not reported (process group died or hung before it)"
            by_msg.setdefault(msg, (msg, []))[1].append(name)
            continue
        fails = {rank: v["fail"].strip() for rank, v in per_rank.items() if v["fail"]}
        for rank in sorted(set(range(outcome.world_size)) - set(per_rank)):
            fails[rank] = "not reported by this rank"
        ranks_by_msg = {}
        for rank, msg in sorted(fails.items()):
            ranks_by_msg.setdefault(msg, []).append(rank)
        for msg, ranks in ranks_by_msg.items():
            key = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", msg)
            by_msg.setdefault(key, (msg, []))[1].append(f"{name} (ranks {ranks})")
    lines = []
    for msg, checks in by_msg.values():
        shown = ", ".join(checks[:4]) + (f", ... ({len(checks)} checks)" if len(checks) > 4 else "")
        first = "(the first) " if len(checks) > 1 else ""
        lines.append(f"{shown}:\n    {first}" + msg.replace("\n", "\n    "))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more distinct failures"]
    return lines


def print_max_errors(outcome, names: list):
    worst = {}
    for name in names:
        for value in outcome.merged().get(name, {}).values():
            impl = name.rsplit("/", 1)[1]
            for k, v in value["errs"].items():
                if math.isfinite(v):
                    worst.setdefault(impl, {})[k] = max(worst.get(impl, {}).get(k, 0.0), v)
    for impl, errs in worst.items():
        print(f"  {impl:18s} max rel err: " + ", ".join(f"{k}={v:.1e}" for k, v in errs.items()))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_single_process(world, sequence_parallel):
    """Loss, lse, ∇e and each rank's ∇c/∇bias shard equal the float64 single-process result."""
    outcome, impls = numerics_group(world)
    names = [
        name
        for layout in LAYOUTS[world]
        if layout.sequence_parallel == sequence_parallel
        for name, _, _ in planned_checks(layout, impls)
    ]
    assert names
    print_max_errors(outcome, names)
    lines = summarize_failures(outcome, names)
    if lines or not outcome.ok:
        n_bad = sum(
            1
            for name in names
            if any(v["fail"] for v in outcome.merged().get(name, {0: {"fail": 1}}).values())
        )
        msg = f"{n_bad} of {len(names)} checks failed at world size {world}:\n" + "\n".join(lines)
        if not outcome.ok:
            msg += "\n" + outcome.describe()
        pytest.fail(msg, pytrace=False)


# ---------------------------------------------------------------------------------------------
# Errors: bad shard layouts and ranks that disagree raise ValueError on every rank, never hang.

ERROR_WORLD = 2
TILING = r"(?i)shard|til|vocab_range|vocab range"


def _error_args(rank, world, name):
    """(e, c, targets, kwargs) for error case `name` on `rank` (world size 2)."""
    n, vocab, dim = 37, V_EVEN, D
    g = torch.Generator().manual_seed(3)
    targets = torch.randint(0, vocab, (n,), generator=g)
    rows = vocab // world
    kwargs = {}
    e_rows, c_rows, d, dtype = n, rows, dim, torch.float32
    if name == "target-equal-vocab":
        targets[3] = vocab
    elif name == "target-negative":
        targets[3] = -5
    elif name == "target-past-uneven-vocab":
        kwargs["vocab_range"] = ((0, 17), (17, V_ODD))[rank]
        c_rows = kwargs["vocab_range"][1] - kwargs["vocab_range"][0]
        targets[3] = V_ODD
    elif name == "bias-full-vocab":
        kwargs["bias"] = torch.randn(vocab, generator=g)
    elif name == "range-length-not-c-rows":
        kwargs["vocab_range"] = (rank * rows, (rank + 1) * rows)
        c_rows = rows - 1
    elif name in ("ranges-gap", "ranges-overlap", "ranges-not-from-zero"):
        ranges = {
            "ranges-gap": ((0, 200), (300, vocab)),
            "ranges-overlap": ((0, 300), (200, vocab)),
            "ranges-not-from-zero": ((16, 300), (300, vocab)),
        }[name]
        kwargs["vocab_range"] = ranges[rank]
        c_rows = ranges[rank][1] - ranges[rank][0]
    elif name == "default-shards-unequal":
        c_rows = rows + rank  # 258 and 259 rows, no vocab_range
    elif name == "range-on-one-rank-only":
        if rank == 0:
            kwargs["vocab_range"] = (0, rows)
    elif name == "dtype-mismatch":
        dtype = torch.float32 if rank == 0 else torch.float16
    elif name == "sp-on-one-rank-only":
        # Rank 0 passes its half of the sequence with sequence_parallel, rank 1 the whole without.
        targets = torch.randint(0, vocab, (12, 3), generator=g)
        if rank == 0:
            kwargs["sequence_parallel"] = True
        e_rows = (6, 3) if rank == 0 else (12, 3)
    elif name == "d-mismatch":
        d = dim if rank == 0 else dim - 8
    elif name == "tokens-mismatch":
        e_rows = n - rank
        targets = targets[:e_rows]
    elif name == "sp-s-not-divisible":
        # s = 13 over 2 ranks: rank 0 holds 7 rows, rank 1 holds 6; targets for the full [13, 3].
        kwargs["sequence_parallel"] = True
        targets = torch.randint(0, vocab, (13, 3), generator=g)
        e_rows = (7, 3) if rank == 0 else (6, 3)
    elif name == "sp-targets-not-full":
        # Each rank passes its own 6 rows of targets instead of the full sequence's 12.
        kwargs["sequence_parallel"] = True
        targets = torch.randint(0, vocab, (6, 3), generator=g)
        e_rows = (6, 3)
    else:
        raise KeyError(name)
    e_shape = e_rows if isinstance(e_rows, tuple) else (e_rows,)
    e = torch.randn(*e_shape, d, generator=g).to(dtype).requires_grad_()
    c = (torch.randn(c_rows, d, generator=g) / math.sqrt(d)).to(dtype).requires_grad_()
    if "bias" in kwargs:
        kwargs["bias"] = kwargs["bias"].to(dtype)
    return e, c, targets, kwargs


# name -> regex the message must match (None: any ValueError). Errors that each rank finds on its
# own come first; those that need the ranks to talk come last.
ERROR_CASES = {
    "target-equal-vocab": str(V_EVEN),
    "target-negative": "-5",
    "target-past-uneven-vocab": str(V_ODD),
    "bias-full-vocab": None,
    "range-length-not-c-rows": None,
    "ranges-gap": TILING,
    "ranges-overlap": TILING,
    "ranges-not-from-zero": TILING,
    "default-shards-unequal": None,
    "range-on-one-rank-only": None,
    "dtype-mismatch": None,
    "sp-on-one-rank-only": None,
    "d-mismatch": None,
    "tokens-mismatch": None,
    "sp-s-not-divisible": None,
    "sp-targets-not-full": None,
}


def _errors_worker(rank, world, report, names):
    group = dist.group.WORLD
    for name in names:
        report.started(name)
        e, c, targets, kwargs = _error_args(rank, world, name)
        try:
            loss = cce_parallel.linear_cross_entropy(e, c, targets, impl="torch", tp_group=group, **kwargs)
            loss.sum().backward()
            outcome = ("no error", f"returned {loss.detach().reshape(-1)[:3].tolist()}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = (type(exc).__name__, str(exc))
        report.result(name, outcome)
        # Re-align the ranks; a rank left inside a collective makes this time out (and says so).
        dist.barrier(group)


@functools.cache
def errors_group():
    return spawn(_errors_worker, ERROR_WORLD, (tuple(ERROR_CASES),), timeout=300.0, collective_timeout=60.0)


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_layout_raises_on_every_rank(name):
    outcome = errors_group()
    per_rank = outcome.merged().get(name, {})
    problems = []
    for rank in range(ERROR_WORLD):
        if rank not in per_rank:
            problems.append(f"rank {rank}: no outcome (hung or died before this case)")
            continue
        kind, msg = per_rank[rank]
        if kind != "ValueError":
            problems.append(f"rank {rank}: expected ValueError, got {kind}: {msg}")
        elif ERROR_CASES[name] and not re.search(ERROR_CASES[name], msg):
            problems.append(f"rank {rank}: ValueError message {msg!r} does not match {ERROR_CASES[name]!r}")
    if problems:
        detail = "" if name in outcome.merged() and outcome.ok else "\n" + outcome.describe()
        pytest.fail(f"{name}:\n" + "\n".join(problems) + detail, pytrace=False)


# ---------------------------------------------------------------------------------------------
# Targets out of range on ONE rank only: every rank raises ValueError, on every path of the forward.
# Each rank's count of bad targets rides along the forward's first SUM all-reduce of statistics
# (the one-pass paths) or takes a small all-reduce of its own before the GEMMs (the lean path):
# before that, only the rank that held the bad target raised, and the others went on into their
# next collective (the backward's, the barrier below) and waited there until the group's timeout.

BAD_V, BAD_D, BAD_N = 32, 16, 12  # two shards of 16 rows; tiny: the interpreter is slow
BAD_TIMEOUT_S = 20.0  # a rank left waiting in a collective fails the case after this, not CI's limit
FINE = r"tensor-parallel rank\(s\) \[{ranks}\] have {count} targets that do not \(the error there names one\)"


@dataclasses.dataclass(frozen=True)
class BadCase:
    name: str
    bad: dict  # rank -> {token index: target value} written into that rank's targets
    path: str  # the forward path the call takes: "one-pass", "two-pass variant" or "lean"
    options: tuple = ()
    grad: bool = True
    sequence_parallel: bool = False

    def expect(self, rank: int) -> str:
        """A regex the ValueError's message on `rank` must match."""
        rule = rf"\[0, {BAD_V}\) or equal ignore_index={self.ignore_index}"
        if rank in self.bad:  # the value, how many of them, and where
            values = self.bad[rank].values()
            first = self.bad[rank][min(self.bad[rank])]
            ranks = ", ".join(str(r) for r in sorted(self.bad))
            return (
                rf"{rule}; found {first} \({len(values)} such targets on tensor-parallel rank {rank}; "
                rf"rank\(s\) with any: \[{ranks}\]\)"
            )
        ranks = ", ".join(str(r) for r in sorted(self.bad))
        count = sum(len(v) for v in self.bad.values())
        return f"{rule}; " + FINE.format(ranks=ranks, count=count)

    @property
    def ignore_index(self) -> int:
        return dict(self.options).get("ignore_index", -100)


BAD_CASES = {
    case.name: case
    for case in [
        BadCase("one-pass-too-large-mean", {1: {3: BAD_V}}, "one-pass"),
        BadCase("one-pass-negative-sum", {0: {5: -5}}, "one-pass", (("reduction", "sum"),)),
        # 4 tokens per block (budget: 4 tokens x 16 rows x 4 bytes): the bad target in the last
        # block, its count sent with the first block's statistics only.
        BadCase("one-pass-blocks-none", {1: {10: BAD_V + 7, 11: -1}}, "one-pass",
                (("reduction", "none"), ("logits_budget", 4 * 16 * 4))),
        BadCase("one-pass-sequence-parallel", {1: {7: -2}}, "one-pass", sequence_parallel=True),
        # softcap with label smoothing: fp32 logits and a statistics pass per block (_stats_of_block)
        BadCase("two-pass-variant", {1: {0: BAD_V}}, "two-pass variant",
                (("softcap", 5.0), ("label_smoothing", 0.1))),
        BadCase("lean", {0: {2: BAD_V}}, "lean", (("logits_budget", "lean"), ("reduction", "none"))),
        BadCase("lean-no-grad", {1: {2: -7}}, "lean", grad=False),
        BadCase("torch-impl", {1: {4: BAD_V + 100}}, "lean", (("impl", "torch"),)),
        BadCase("torch-impl-sequence-parallel", {0: {1: -3}}, "lean", (("impl", "torch"),),
                sequence_parallel=True),
        # -100 is an ordinary (bad) target when ignore_index is another number
        BadCase("ignore-index-other", {1: {6: -100}}, "one-pass", (("ignore_index", -1),)),
        BadCase("both-ranks", {0: {1: BAD_V}, 1: {9: -4, 10: -4}}, "one-pass"),
    ]
}


def _bad_targets_worker(rank, world, report, names, device_type):
    from cce_parallel.ops import autograd, common

    paths = []
    one_pass, local_stats = autograd.one_pass, autograd.local_stats

    def spy_one_pass(e, *args, **kwargs):
        cfg = next(a for a in args if isinstance(a, common.LossConfig))
        fused = common.fused_one_pass(e.dtype, cfg.softcap, cfg.label_smoothing)
        paths.append("one-pass" if fused else "two-pass variant")
        return one_pass(e, *args, **kwargs)

    def spy_local_stats(*args):
        paths.append("lean")
        return local_stats(*args)

    autograd.one_pass, autograd.local_stats = spy_one_pass, spy_local_stats
    group = dist.group.WORLD
    for name in names + ("fine-after",):
        report.started(name)
        case = BAD_CASES.get(name, BadCase("fine-after", {}, "one-pass"))
        opts = {"impl": "cce_kahan_full_c", **dict(case.options)}
        g = torch.Generator().manual_seed(11)  # the same inputs on every rank
        e = torch.randn(BAD_N, BAD_D, generator=g)
        c = torch.randn(BAD_V, BAD_D, generator=g) / math.sqrt(BAD_D)
        targets = torch.randint(0, BAD_V, (BAD_N,), generator=g)
        for i, value in case.bad.get(rank, {}).items():
            targets[i] = value
        rows = BAD_V // world
        c = c[rank * rows:(rank + 1) * rows]
        if case.sequence_parallel:  # [s, b] = [6, 2]: this rank's 3 rows of e, the targets of all 6
            s_local = BAD_N // 2 // world
            e = e.view(BAD_N // 2, 2, BAD_D)[rank * s_local:(rank + 1) * s_local]
            targets = targets.view(-1, 2)
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        e, c, targets = e.to(device), c.to(device), targets.to(device)
        e, c = e.requires_grad_(case.grad), c.requires_grad_(case.grad)
        paths.clear()
        try:
            loss = cce_parallel.linear_cross_entropy(
                e, c, targets, tp_group=group, sequence_parallel=case.sequence_parallel, **opts
            )
            if case.grad:
                loss.sum().backward()  # the lean path's backward all-reduces dE
            outcome = ("no error", f"returned {loss.detach().reshape(-1)[:3].tolist()}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = (type(exc).__name__, str(exc))
        report.result(name, (*outcome, list(paths)))
        # The next collective: a rank left behind by the others times out here.
        dist.barrier(group)


def _bad_case_runs(case: BadCase, impls) -> bool:
    """Without the Triton impls (CCE_TEST_GPU=1 and fewer than 2 GPUs) only impl "torch" runs."""
    return dict(case.options).get("impl", "cce_kahan_full_c") in impls


@functools.cache
def bad_targets_group():
    backend, device_type, impls = small_setup(2)  # NCCL on 2 GPUs with CCE_TEST_GPU=1
    names = tuple(name for name, case in BAD_CASES.items() if _bad_case_runs(case, impls))
    # NCCL: a rank's first call may compile every Triton kernel while the other waits for it
    timeout_s = BAD_TIMEOUT_S if backend == "gloo" else 600.0
    outcome = spawn(
        _bad_targets_worker, 2, (names, device_type), backend=backend, timeout=GROUP_TIMEOUT_S[backend],
        collective_timeout=timeout_s, grace=5.0,
    )
    return outcome, impls


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_targets_on_one_rank_raise_on_every_rank(name):
    """Targets outside [0, V) on one rank only (or different ones on each): every rank raises a
    ValueError; the rank that has them names a value and their count, the others name that rank."""
    case = BAD_CASES[name]
    outcome, impls = bad_targets_group()
    if not _bad_case_runs(case, impls):
        pytest.skip("the Triton impls need the interpreter on CPU, or CCE_TEST_GPU=1 with 2 GPUs")
    per_rank = outcome.merged().get(name, {})
    problems = []
    for rank in range(2):
        if rank not in per_rank:
            problems.append(f"rank {rank}: no outcome (hung or died before this case)")
            continue
        kind, msg, paths = per_rank[rank]
        if paths != [case.path]:
            problems.append(f"rank {rank}: the forward took {paths}, the case is for [{case.path!r}]")
        if kind != "ValueError":
            problems.append(f"rank {rank}: expected ValueError, got {kind}: {msg}")
        elif not re.search(case.expect(rank), msg):
            problems.append(f"rank {rank}: ValueError message {msg!r} does not match {case.expect(rank)!r}")
    if problems:
        pytest.fail(f"{name}:\n" + "\n".join(problems) + "\n" + outcome.describe(), pytrace=False)


def test_group_usable_after_bad_targets():
    """After all those errors, a call with good targets runs on every rank: no collective was left
    half-done."""
    outcome, _ = bad_targets_group()
    per_rank = outcome.merged().get("fine-after", {})
    assert outcome.ok and sorted(per_rank) == [0, 1], outcome.describe()
    assert all(per_rank[r][0] == "no error" for r in per_rank), per_rank


def test_bad_target_counts_are_exact_over_ranks():
    """Each rank's count of bad targets travels as two fp32 numbers below 2^24 in its own slots:
    summed over ranks, every rank reads every count exactly, also past fp32's 2^24."""
    from cce_parallel.ops.common import Collectives, _BadTargets

    world = 3
    counts = [0, 2**40 + 2**24 + 3, 2**24 - 1]

    class Rank(Collectives):
        def __init__(self, rank):
            self.rank, self.world, self.first = rank, world, rank == 0

    seen, slots = [], []
    for rank in range(world):
        bad = _BadTargets(torch.tensor([7, counts[rank]]), Rank(rank), seen.append)
        slots.append(bad.take())
        assert slots[-1].dtype == torch.float32 and bad.take() is None
    bad.summed(torch.stack(slots).sum(dim=0))
    assert seen[0].dtype == torch.int64 and seen[0].tolist() == counts


def test_sequence_parallel_needs_tp_group():
    e, c = torch.randn(12, 3, D), torch.randn(V_EVEN, D)
    targets = torch.randint(0, V_EVEN, (12, 3))
    with pytest.raises(ValueError):
        cce_parallel.linear_cross_entropy(e, c, targets, impl="torch", sequence_parallel=True)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at a Llama-3 shape on 2 and 4 GPUs (NCCL) against a single-GPU run of the same impl.

GPU_TOL = {"loss": 1e-4, "lse": 1e-4, "de": 1e-2, "dc": 1e-2, "dbias": 1e-2}
GPU_SHAPE = (4096, 128256, 4096)  # N, V, D


@dataclasses.dataclass(frozen=True)
class GpuCase:
    name: str
    peaked: bool
    sequence_parallel: bool = False
    bias: bool = False
    ignore_frac: float = 0.0
    options: tuple = ()

    @property
    def opts(self) -> dict:
        return dict(self.options)

    def inputs(self, device, shape=GPU_SHAPE):
        n, vocab, dim = shape
        lead = (n // 2, 2) if self.sequence_parallel else (n,)
        if self.peaked:
            return peaked_inputs(
                lead,
                vocab,
                dim,
                dtype=torch.bfloat16,
                device=device,
                n_head=256,
                n_mid=min(4096, vocab // 4),
                boost=7.0,
                n_rare=n // 64,
            )
        return random_inputs(
            lead,
            vocab,
            dim,
            dtype=torch.bfloat16,
            device=device,
            bias=self.bias,
            ignore_frac=self.ignore_frac,
        )


GPU_CASES = (
    GpuCase("llama3-peaked-mean", peaked=True, options=(("reduction", "mean"),)),
    # per-token random weights: the one-pass dE scaled per row, dC recomputed
    GpuCase("llama3-peaked-sp-none", peaked=True, sequence_parallel=True, options=(("reduction", "none"),)),
    # several token blocks of the one-pass path (128 MB of logits: 1,023 tokens at V = 32,064 per rank)
    GpuCase("llama3-peaked-sp-blocks", peaked=True, sequence_parallel=True, options=(("logits_budget", 128 << 20),)),
    GpuCase(
        "random-all-options",
        peaked=False,
        bias=True,
        ignore_frac=0.1,
        options=(
            ("softcap", 30.0),
            ("label_smoothing", 0.1),
            ("z_loss", 1e-4),
            ("reduction", "sum"),
            ("return_lse", True),
        ),
    ),
)


def _gpu_worker(rank, world, report, impls, device_type="cuda", shape=GPU_SHAPE):
    """device_type "cpu" and a small shape with impl "torch": a dry run of this test's plumbing."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    for case in GPU_CASES:
        inputs = case.inputs(device, shape)
        # The same seed must give the same inputs on every GPU.
        sums = torch.stack(
            [inputs["e"].double().sum(), inputs["c"].double().sum(), inputs["targets"].double().sum()]
        )
        gathered = [torch.empty_like(sums) for _ in range(world)]
        dist.all_gather(gathered, sums, group=group)
        assert all(torch.equal(g, sums) for g in gathered), "ranks built different inputs"
        opts = case.opts
        grad_loss, grad_lse = upstream(
            inputs["targets"], opts.get("reduction", "mean"), opts.get("return_lse")
        )
        vocab = inputs["c"].shape[0]
        layout = Layout(case.name, vocab, None, case.sequence_parallel)
        local, rows = local_view(inputs, layout, rank, world)
        fn = tp_call(group, layout, rank)
        for impl in impls:
            name = f"{case.name}/{impl}"
            report.started(name)
            options = dict(opts, impl=impl)
            out, errs, fail = None, {}, None
            try:
                single = run(cce_parallel.linear_cross_entropy, inputs, options, grad_loss, grad_lse)
                expected = expected_shard(single, layout, rank, world, rows)
                out = run(fn, local, options, grad_loss, grad_lse)
                check_meta(out, local, options)
                errs = shard_errors(out, expected, single)
                del expected, single
                fail = too_large(errs, GPU_TOL, "single GPU")
            except Exception as exc:  # noqa: BLE001
                out, fail = None, _describe(exc)
            _, disagree = _ranks_agree(out, case.sequence_parallel, group)
            if disagree and fail is None:
                fail = "ranks disagree: " + disagree
            report.result(name, {"fail": fail, "errs": errs})
            del out
            if device.type == "cuda":
                torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_bf16_real_shape(world):
    """bf16, N=4096, V=128256, D=4096 split over `world` GPUs vs one GPU with the same impl."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    impls = ("cce", "cce_kahan_full_c")
    outcome = spawn(_gpu_worker, world, (impls,), backend="nccl", timeout=1500.0, collective_timeout=600.0)
    names = [f"{case.name}/{impl}" for case in GPU_CASES for impl in impls]
    merged = outcome.merged()
    n, vocab, dim = GPU_SHAPE
    print(
        f"\n[world {world}] bf16 N={n} V={vocab} D={dim}: rel. error of TP vs single GPU ({outcome.seconds:.0f} s)"
    )
    for name in names:
        for rank, value in sorted(merged.get(name, {}).items()):
            shown = ", ".join(f"{k}={v:.2e}" for k, v in value["errs"].items())
            print(f"  {name:40s} rank {rank}: {shown}")
    lines = summarize_failures(outcome, names)
    if lines or not outcome.ok:
        msg = "\n".join(lines) + ("" if outcome.ok else "\n" + outcome.describe())
        pytest.fail(msg, pytrace=False)


# ---------------------------------------------------------------------------------------------
# GPU: every calling pattern in bf16 at TP 2 (uneven shards, with and without SP) against the
# float64 oracle, no worse than plain bf16 PyTorch on the same inputs.

PATTERN_SHAPE = (4096, 50257, 2048)  # N, V (odd: shards of 25,129 and 25,128 rows), D
PATTERN_RANGES = ((0, 25129), (25129, 50257))
# name: (weights given in the forward, reduction, upstream of a per-token loss, state flag, path run)
PATTERNS = {
    "weights-signed": ("signed", "mean", None, None, None),
    "weights-mask": ("mask", "mean", None, None, None),
    "unfolded-mask": (None, "none", "masked", "masked_weights_seen", "mask_corrected"),
    "backward-weights": (None, "none", "random", "per_token_weights_seen", "deferred"),
}


def _pattern_worker(rank, world, report, device_type="cuda", shape=PATTERN_SHAPE, ranges=PATTERN_RANGES):
    """device_type "cpu" with a small shape and ranges: a dry run of this test's plumbing."""
    from tests.ops.test_gpu import worse_than_plain
    from tests.oracle import plain_torch

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    n, vocab, dim = shape
    for sequence_parallel in (False, True):
        layout = Layout("patterns", vocab, ranges, sequence_parallel)
        lead = (n // 2, 2) if sequence_parallel else (n,)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter: fp32 only
        inputs = peaked_inputs(lead, vocab, dim, dtype=dtype, device=device, n_head=min(256, vocab // 16),
                               n_mid=min(4096, vocab // 4), boost=7.0, n_rare=max(n // 64, 1))
        local, rows = local_view(inputs, layout, rank, world)
        targets = inputs["targets"]
        g = torch.Generator(device=device).manual_seed(11)
        for pattern, (kind, reduction, grad_kind, flag, path) in PATTERNS.items():
            name = f"{pattern}{'-sp' if sequence_parallel else ''}"
            report.started(name)
            opts = {"reduction": reduction}
            if kind == "signed":
                opts["weights"] = torch.randn(targets.shape, generator=g, device=device)
            elif kind == "mask":
                opts["weights"] = (torch.rand(targets.shape, generator=g, device=device) >= 0.1).float()
            grad_loss = torch.randn((), generator=g, device=device)
            if grad_kind == "masked":  # Megatron's loss_mask / count, the mask not folded
                keep = (torch.rand(targets.shape, generator=g, device=device) >= 0.1).float()
                grad_loss = keep / keep.sum()
            elif grad_kind == "random":
                grad_loss = torch.randn(targets.shape, generator=g, device=device) / targets.numel()
            ref = oracle(**inputs, grad_loss=grad_loss, chunk_size=2**26 // vocab, **opts)
            plain = plain_torch(**inputs, grad_loss=grad_loss, **opts)
            expected = expected_shard(ref, layout, rank, world, rows)
            plain_errs = shard_errors(expected_shard(plain, layout, rank, world, rows), expected, ref)
            del plain
            state = cce_parallel.UpstreamState()
            if flag:
                setattr(state, flag, True)
            if grad_kind == "masked":  # the last mask's rows: about half of these are taken out before the sync
                state.masked_rows = n // 20
            call = functools.partial(tp_call(group, layout, rank), state=state)
            out, errs, fail = None, {}, None
            try:
                out = run(call, local, dict(opts, impl="cce_kahan_full_c"), grad_loss)
                errs = shard_errors(out, expected, ref)
                bad = worse_than_plain(errs, plain_errs)
                if bad:
                    fail = f"worse than plain bf16 PyTorch: {bad} vs {plain_errs}"
                ran = dict(state.paths)
                if path and ran.get(path) != 1:
                    fail = fail or f"path {path!r} did not run once: {ran}"
                if not path and any(ran.get(k) for k in ("recomputed", "mask_corrected", "deferred", "lean")):
                    fail = fail or f"weights in the forward took a second pass: {ran}"
            except Exception as exc:  # noqa: BLE001
                out, fail = None, _describe(exc)
            _, disagree = _ranks_agree(out, sequence_parallel, group)
            if disagree and fail is None:
                fail = "ranks disagree: " + disagree
            report.result(name, {"fail": fail, "errs": errs, "plain": plain_errs})
            del out, ref, expected
            if device.type == "cuda":
                torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_calling_patterns_bf16_tp2():
    """Weights in the forward (signed, and a 10 % mask), an unfolded mask and weights only in the
    backward, bf16 at N=4096, V=50257 (uneven shards), D=2048 over 2 GPUs with and without SP: the
    loss and gradients against the fp64 oracle are no worse than plain bf16 PyTorch's (5 % slack),
    and each call takes its own path (state.paths)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    outcome = spawn(_pattern_worker, 2, backend="nccl", timeout=900.0, collective_timeout=300.0)
    names = [f"{p}{sp}" for sp in ("", "-sp") for p in PATTERNS]
    merged = outcome.merged()
    print(f"\n[TP 2] bf16 calling patterns, error vs fp64 (plain bf16 PyTorch) ({outcome.seconds:.0f} s)")
    for name in names:
        for rank, value in sorted(merged.get(name, {}).items()):
            shown = ", ".join(f"{k}={v:.2e} ({value['plain'].get(k, float('nan')):.2e})"
                              for k, v in value["errs"].items())
            print(f"  {name:22s} rank {rank}: {shown}")
    lines = summarize_failures(outcome, names)
    if lines or not outcome.ok:
        msg = "\n".join(lines) + ("" if outcome.ok else "\n" + outcome.describe())
        pytest.fail(msg, pytrace=False)
