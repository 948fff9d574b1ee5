"""linear_cross_entropy with DTensor inputs, and under torch FSDP2, against single-process runs.

CPU over gloo (tests/dist.py), one group per world size (spawning a group costs seconds), whose
workers run their parts in turn, each test reading its part's results: the 2-rank group checks a
1-D mesh and FSDP2 training, the 4-rank group a 2-D mesh (dp x tp, in both orders) and FSDP2 +
TP training. Every rank builds the same seeded full
inputs; the DTensor run's loss, and its gradients gathered with full_tensor(), must equal a plain
single-process call of the same impl on the full tensors, and each gradient must be a DTensor
placed like its input. Bad inputs must raise a ValueError naming the problem on every rank.

impl "torch" and one Triton impl ("cce", under the Triton interpreter) run; shapes are tiny.
test_gpu_fsdp2_tp trains a GPT-style toy with FSDP2 + TP on 2 GPUs through torchrun/NCCL.
"""

import functools
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import cce_parallel
from cce_parallel.parallel.dtensor import chunk_range
from tests.dist import spawn
from tests.helpers import child_pythonpath

pytestmark = pytest.mark.distributed

D = 8
IMPLS = ("torch", "cce")
# Same impl, same dtype (fp32): only the order of sums differs between sharded and whole runs.
TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(vocab, lead, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    return dict(
        e=torch.randn(*lead, D, generator=g) * 2,
        c=torch.randn(vocab, D, generator=g) / D**0.5,
        bias=torch.randn(vocab, generator=g) * 0.5 if bias else None,
        targets=torch.randint(0, vocab, lead, generator=g),
        upstream=torch.randn(*lead, generator=g),
    )


def _scalarize(out, reduction, upstream):
    """One number to differentiate: loss (weighted per token for "none"), plus lse where returned."""
    loss, lse = out if isinstance(out, tuple) else (out, None)
    total = (loss * upstream).sum() if reduction == "none" else loss
    return total if lse is None else total + (lse * upstream.flip(-1)).sum()


def _values(out):
    return tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()


def _reference(x, impl, options):
    e = x["e"].clone().requires_grad_()
    c = x["c"].clone().requires_grad_()
    bias = None if x["bias"] is None else x["bias"].clone().requires_grad_()
    out = cce_parallel.linear_cross_entropy(e, c, x["targets"], bias=bias, impl=impl, **options)
    _scalarize(out, options.get("reduction", "mean"), x["upstream"]).backward()
    return dict(loss=_values(out), e=e.grad, c=c.grad, bias=None if bias is None else bias.grad)


def _leaf(t, mesh, placements):
    return distribute_tensor(t, mesh, placements).detach().requires_grad_()


def _check_dtensor_run(x, impl, options, mesh, c_pl, e_pl=None, targets_pl=None):
    """Run with c (and bias) placed as c_pl, e as e_pl (None: a plain full tensor); compare."""
    ref = _reference(x, impl, options)
    c = _leaf(x["c"], mesh, c_pl)
    bias = None if x["bias"] is None else _leaf(x["bias"], mesh, c_pl)
    e = x["e"].clone().requires_grad_() if e_pl is None else _leaf(x["e"], mesh, e_pl)
    targets = x["targets"] if targets_pl is None else distribute_tensor(x["targets"], mesh, targets_pl)
    out = cce_parallel.linear_cross_entropy(e, c, targets, bias=bias, impl=impl, **options)
    assert not any(isinstance(t, DTensor) for t in (out if isinstance(out, tuple) else (out,)))
    torch.testing.assert_close(_values(out), ref["loss"], **TOL)
    _scalarize(out, options.get("reduction", "mean"), x["upstream"]).backward()
    for name, t, pl in (("c", c, c_pl), ("bias", bias, c_pl), ("e", e, e_pl)):
        if t is None:
            continue
        if pl is None:
            torch.testing.assert_close(t.grad, ref[name], **TOL)
            continue
        assert isinstance(t.grad, DTensor), f"∇{name} is a {type(t.grad).__name__}, not a DTensor"
        assert tuple(t.grad.placements) == tuple(pl), f"∇{name} placed {t.grad.placements}, {name} {pl}"
        assert t.grad.device_mesh == mesh
        torch.testing.assert_close(t.grad.full_tensor(), ref[name], **TOL)


def _check_chunks(mesh, dim):
    for v in range(1, 14):
        shape, offset = compute_local_shape_and_global_offset(
            (v, D), mesh, [Shard(0) if d == dim else Replicate() for d in range(mesh.ndim)]
        )
        lo, hi = chunk_range(v, mesh.size(dim), mesh.get_local_rank(dim))
        assert (hi - lo, lo if hi > lo else offset[0]) == (shape[0], offset[0]), (v, (lo, hi), shape, offset)


def _expect_error(report, name, fn, *needles):
    """fn() must raise ValueError/TypeError whose message holds every needle (on every rank)."""
    report.started(name)
    try:
        fn()
    except (ValueError, TypeError) as err:
        msg = str(err)
        missing = [n for n in needles if n not in msg]
        report.result(name, f"message lacks {missing}: {msg}" if missing else None)
        return
    report.result(name, "no error raised")


def _run_case(report, name, fn):
    report.started(name)
    try:
        fn()
        report.result(name, None)
    except Exception as err:  # noqa: BLE001 - reported per case
        report.result(name, f"{type(err).__name__}: {err}")


# ---------------------------------------------------------------------------------------------
# 1-D mesh of 2 ranks


def _tied_case(mesh, impl):
    """Tied head: c is both the (vocab-sharded) embedding table and the classifier."""
    x = _inputs(37, (5, 3), seed=3)
    tokens = torch.randint(0, 37, (5, 3), generator=torch.Generator().manual_seed(4))
    w = torch.randn(D, D, generator=torch.Generator().manual_seed(5)) / D**0.5

    def loss_of(c, tokens):
        h = F.embedding(tokens, c)
        if isinstance(h, DTensor):
            h = h.redistribute(h.device_mesh, [Replicate()]).to_local()
        e = torch.tanh(h @ w)
        return cce_parallel.linear_cross_entropy(e, c, x["targets"], impl=impl, reduction="sum")

    c_ref = x["c"].clone().requires_grad_()
    ref = loss_of(c_ref, tokens)
    ref.backward()
    c = _leaf(x["c"], mesh, [Shard(0)])
    loss = loss_of(c, distribute_tensor(tokens, mesh, [Replicate()]))
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    loss.backward()
    assert isinstance(c.grad, DTensor) and tuple(c.grad.placements) == (Shard(0),)
    torch.testing.assert_close(c.grad.full_tensor(), c_ref.grad, **TOL)


def _batch_first_case(mesh):
    """torch's sequence-parallel layout [b, s, D] Shard(1): rejected with a hint; its transpose
    (a non-contiguous local view, Shard(0)) runs as sequence parallel."""
    x = _inputs(37, (2, 6), bias=True)
    c = _leaf(x["c"], mesh, [Shard(0)])
    e = _leaf(x["e"], mesh, [Shard(1)])
    try:
        cce_parallel.linear_cross_entropy(e, c, x["targets"])
        raise AssertionError("e Shard(1) was accepted")
    except ValueError as err:
        assert "e.transpose(0, 1)" in str(err), str(err)
    t = dict(x, e=x["e"].transpose(0, 1), targets=x["targets"].T, upstream=x["upstream"].T)
    ref = _reference(t, "torch", dict(reduction="none"))
    bias = _leaf(x["bias"], mesh, [Shard(0)])
    loss = cce_parallel.linear_cross_entropy(
        e.transpose(0, 1), c, x["targets"].T, bias=bias, impl="torch", reduction="none"
    )
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL)
    (loss * t["upstream"]).sum().backward()
    assert tuple(e.grad.placements) == (Shard(1),) and tuple(c.grad.placements) == (Shard(0),)
    torch.testing.assert_close(e.grad.full_tensor().transpose(0, 1), ref["e"], **TOL)
    torch.testing.assert_close(c.grad.full_tensor(), ref["c"], **TOL)
    torch.testing.assert_close(bias.grad.full_tensor(), ref["bias"], **TOL)


def _mesh2_worker(rank, world, report):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    _run_case(report, "chunks", lambda: _check_chunks(mesh, 0))
    V = 37  # uneven: 19 + 18 rows
    for impl in IMPLS:
        cases = {
            "c-shard/e-replicate/bias/mean": (
                _inputs(V, (7,), bias=True),
                {},
                [Shard(0)],
                [Replicate()],
                None,
            ),
            "c-shard/e-plain/none-lse": (
                _inputs(V, (2, 5)),
                dict(reduction="none", return_lse=True, z_loss=1e-3),
                [Shard(0)],
                None,
                None,
            ),
            "c-shard/e-sp/sum": (
                _inputs(V, (6, 2), bias=True),
                dict(reduction="sum"),
                [Shard(0)],
                [Shard(0)],
                None,
            ),
            "c-shard/e-sp/targets-dtensor/none": (
                _inputs(V, (4, 3)),
                dict(reduction="none", label_smoothing=0.1),
                [Shard(0)],
                [Shard(0)],
                [Shard(0)],
            ),
            "c-replicate/e-replicate": (
                _inputs(V, (7,), bias=True),
                {},
                [Replicate()],
                [Replicate()],
                [Replicate()],
            ),
        }
        for name, (x, options, c_pl, e_pl, t_pl) in cases.items():
            _run_case(
                report,
                f"{name}/{impl}",
                lambda: _check_dtensor_run(x, impl, options, mesh, c_pl, e_pl, t_pl),
            )
        _run_case(report, f"tied/{impl}", lambda: _tied_case(mesh, impl))

    _run_case(report, "sp-batch-first-transposed", lambda: _batch_first_case(mesh))

    x = _inputs(V, (4, 3), bias=True)
    c = distribute_tensor(x["c"], mesh, [Shard(0)])
    e_rep = distribute_tensor(x["e"], mesh, [Replicate()])
    t = x["targets"]
    lce = cce_parallel.linear_cross_entropy
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
    _expect_error(
        report,
        "error/c-partial",
        lambda: lce(x["e"], DTensor.from_local(x["c"], mesh, [Partial()]), t),
        "Partial",
        "c as a DTensor",
    )
    _expect_error(
        report,
        "error/c-shard1",
        lambda: lce(x["e"], distribute_tensor(x["c"], mesh, [Shard(1)]), t),
        "Shard(dim=1)",
        "c as a DTensor",
    )
    _expect_error(
        report,
        "error/e-partial",
        lambda: lce(DTensor.from_local(x["e"], mesh, [Partial()]), c, t),
        "e as a DTensor",
        "Partial",
    )
    _expect_error(
        report,
        "error/e-other-mesh",
        lambda: lce(distribute_tensor(x["e"], other, [Replicate()]), c, t),
        "different meshes",
    )
    _expect_error(report, "error/c-plain", lambda: lce(e_rep, x["c"], t), "c is not")
    _expect_error(
        report,
        "error/bias-placement",
        lambda: lce(e_rep, c, t, bias=distribute_tensor(x["bias"], mesh, [Replicate()])),
        "bias must be placed like c",
    )
    _expect_error(
        report,
        "error/e-sharded-c-replicated",
        lambda: lce(
            distribute_tensor(x["e"], mesh, [Shard(0)]), distribute_tensor(x["c"], mesh, [Replicate()]), t
        ),
        "e as a DTensor",
        "Shard(dim=0)",
    )
    _expect_error(
        report,
        "error/sp-uneven",
        lambda: lce(
            distribute_tensor(_inputs(V, (5, 3))["e"], mesh, [Shard(0)]), c, _inputs(V, (5, 3))["targets"]
        ),
        "not divisible",
    )
    _expect_error(
        report,
        "error/sp-flag-but-replicated",
        lambda: lce(e_rep, c, t, sequence_parallel=True),
        "sequence_parallel=True",
    )
    # Disagrees on rank 1 only: rank 1 names it, rank 0 hears of it (no hang).
    bad_range = (0, 19) if rank == 0 else (18, 37)
    _expect_error(
        report,
        "error/vocab-range",
        lambda: lce(e_rep, c, t, vocab_range=bad_range),
        "vocab_range (18, 37) disagrees" if rank else "rank(s) [1]",
    )
    # The same layout given explicitly is accepted.
    _run_case(
        report,
        "explicit-matching-layout",
        lambda: lce(e_rep, c, t, tp_group=dist.group.WORLD, vocab_range=chunk_range(V, world, rank)),
    )


class _Part:
    """The report a part of a group's worker gets: its case names prefixed with "part/"."""

    def __init__(self, report, part):
        self._report, self._part = report, part

    def started(self, name):
        self._report.started(f"{self._part}/{name}")

    def result(self, name, value=None):
        self._report.result(f"{self._part}/{name}", value)


def _group_worker(rank, world, report):
    """The parts of the group of this world size, in turn; one that raises is reported as
    "part/worker" and the next one still runs."""
    for part, worker in PARTS[world]:
        try:
            worker(rank, world, _Part(report, part))
        except Exception:  # noqa: BLE001 - reported to the parent
            report.result(f"{part}/worker", traceback.format_exc(limit=-6))


@functools.cache
def _group(world: int):
    """One process group per world size, shared by the tests of its parts."""
    return spawn(_group_worker, world, timeout=600.0 * len(PARTS[world]), collective_timeout=60.0)


def _results(world: int, part: str) -> dict:
    """name -> {rank: message} of one part's cases (None: passed)."""
    prefix = f"{part}/"
    return {k[len(prefix):]: v for k, v in _group(world).merged().items() if k.startswith(prefix)}


def _failures(world: int, part: str) -> list:
    outcome = _group(world)
    if not outcome.ok:
        return [outcome.describe()]
    return [f"{name} (rank {r}): {msg}" for name, per in _results(world, part).items() for r, msg in per.items() if msg]


def _check_part(world: int, part: str, cases: int):
    failures = _failures(world, part)
    assert not failures, "\n".join(failures)
    results = _results(world, part)
    assert len([name for name, per in results.items() if 0 in per]) == cases, sorted(results)  # every case ran


def test_dtensor_1d_mesh():
    _check_part(2, "mesh2", 1 + 6 * len(IMPLS) + 12)


# ---------------------------------------------------------------------------------------------
# 2-D mesh of 4 ranks (dp x tp and tp x dp)


def _mesh4_worker(rank, world, report):
    lce = cce_parallel.linear_cross_entropy
    for names in (("dp", "tp"), ("tp", "dp")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        tp = names.index("tp")
        place = lambda p: [p if d == tp else Replicate() for d in range(2)]
        _run_case(report, f"{names}/chunks", lambda: _check_chunks(mesh, tp))
        impls = IMPLS if names == ("dp", "tp") else ("torch",)
        for impl in impls:
            x = _inputs(23, (4, 3), bias=True)
            _run_case(
                report,
                f"{names}/sp/{impl}",
                lambda: _check_dtensor_run(
                    x, impl, dict(reduction="none"), mesh, place(Shard(0)), place(Shard(0))
                ),
            )
            _run_case(
                report,
                f"{names}/replicated-e/{impl}",
                lambda: _check_dtensor_run(x, impl, {}, mesh, place(Shard(0)), place(Replicate())),
            )
        x = _inputs(23, (4, 3))
        c = distribute_tensor(x["c"], mesh, place(Shard(0)))
        dp = 1 - tp
        _expect_error(
            report,
            f"{names}/error/tp-group",
            lambda: lce(x["e"], c, x["targets"], tp_group=mesh.get_group(dp)),
            "tp_group (ranks",
            "disagrees",
        )
        e_dp = distribute_tensor(x["e"], mesh, [Shard(0) if d == dp else Replicate() for d in range(2)])
        _expect_error(
            report,
            f"{names}/error/e-sharded-on-dp",
            lambda: lce(e_dp, c, x["targets"]),
            "c is not sharded on",
        )
        c_both = distribute_tensor(x["c"], mesh, [Shard(0), Shard(0)])
        _expect_error(
            report,
            f"{names}/error/c-sharded-twice",
            lambda: lce(x["e"], c_both, x["targets"]),
            "one mesh dimension only",
        )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    _run_case(report, "1d/chunks", lambda: _check_chunks(mesh, 0))
    # torch.chunk's split of 10 rows over 4 ranks is 3, 3, 3, 1 (not 3, 3, 2, 2).
    x = _inputs(10, (4, 3), bias=True)
    _run_case(
        report, "1d/uneven-sp", lambda: _check_dtensor_run(x, "torch", {}, mesh, [Shard(0)], [Shard(0)])
    )
    x = _inputs(9, (5,))  # chunks of 3: rank 3 gets no rows
    _expect_error(
        report,
        "1d/error/empty-shard",
        lambda: lce(x["e"], distribute_tensor(x["c"], mesh, [Shard(0)]), x["targets"]),
        "gives this rank no rows" if rank == 3 else "rank(s) [3]",
    )


def test_dtensor_2d_mesh():
    _check_part(4, "mesh4", 2 * 4 + 2 * len(IMPLS) + 2 + 3)


# ---------------------------------------------------------------------------------------------
# FSDP2 (fully_shard) on a 1-D data-parallel mesh


class ToyLM(torch.nn.Module):
    """Embedding, two residual MLP blocks, a head (separate or tied); the CCE loss in forward, where
    FSDP2 has the head's weight gathered (outside forward it is the dp-sharded DTensor)."""

    def __init__(self, vocab, dim, tied, impl):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = None if tied else torch.nn.Linear(dim, vocab, bias=False)
        self.impl = impl

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        c = self.embed.weight if self.head is None else self.head.weight
        return cce_parallel.linear_cross_entropy(self.norm(h), c, targets, impl=self.impl)


def _fsdp2_worker(rank, world, report):
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    vocab, steps = 29, 3
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(0, vocab, (world * 2, 6), generator=g) for _ in range(steps)]
    for tied in (False, True):
        for impl in IMPLS:
            name = f"{'tied' if tied else 'untied'}/{impl}"

            def case():
                torch.manual_seed(0)
                ref = ToyLM(vocab, 16, tied, impl)
                torch.manual_seed(0)
                model = ToyLM(vocab, 16, tied, impl)
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                for batch in data:
                    tokens, targets = batch[:, :-1], batch[:, 1:]
                    # The reference sees the whole batch; each rank its rows (equal token counts, so
                    # FSDP2's averaged gradients equal the whole batch's mean-loss gradient).
                    loss_ref = ref(tokens, targets)
                    opt_ref.zero_grad()
                    loss_ref.backward()
                    opt_ref.step()
                    rows = slice(2 * rank, 2 * rank + 2)
                    loss = model(tokens[rows], targets[rows])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    mean = loss.detach().clone()
                    dist.all_reduce(mean)
                    torch.testing.assert_close(mean / world, loss_ref.detach(), rtol=1e-5, atol=1e-6)
                for (n, p), (n_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
                    assert n == n_ref and isinstance(p, DTensor), (n, n_ref, type(p))
                    torch.testing.assert_close(
                        p.full_tensor(), p_ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}"
                    )

            _run_case(report, name, case)


def test_fsdp2_training_matches_unsharded():
    _check_part(2, "fsdp2", 2 * len(IMPLS))


# ---------------------------------------------------------------------------------------------
# FSDP2 + tensor parallelism on a 2-D (dp, tp) mesh: a GPT-style toy, CPU (gloo) and GPU (NCCL)


class Attention(torch.nn.Module):
    """Causal self-attention; the number of heads follows q's width, so a TP shard runs its heads."""

    def __init__(self, dim, head_dim):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.head_dim = head_dim

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(torch.nn.Module):
    def __init__(self, dim, head_dim):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = Attention(dim, head_dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPTToy(torch.nn.Module):
    """Token embedding, pre-norm blocks, final norm, head (separate or tied); CCE loss in forward."""

    def __init__(self, vocab, dim, heads, layers, tied, impl):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(64, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, dim // heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = None if tied else torch.nn.Linear(dim, vocab, bias=False)
        self.impl = impl

    def forward(self, tokens, targets):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        # Under TP the head's weight (or the tied embedding's) is a DTensor Shard(0) on the tp mesh:
        # linear_cross_entropy takes tp_group and vocab_range from it.
        c = self.embed.weight if self.head is None else self.head.weight
        self.c_layout = (type(c).__name__, tuple(getattr(c, "placements", ())))
        return cce_parallel.linear_cross_entropy(self.norm(h), c, targets, impl=self.impl)


def _fsdp_tp_train(device, tp, impls, report, vocab=37, steps=3):
    """Train GPTToy with TP over mesh dim "tp" and FSDP2 over "dp"; compare with the whole model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp = dist.get_world_size() // tp
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(11)
    rows = 2  # sequences per dp rank
    data = [torch.randint(0, vocab, (dp * rows, 9), generator=g).to(device) for _ in range(steps)]
    plan = {
        **{f"blocks.{i}.attn.{p}": ColwiseParallel() for i in range(2) for p in "qkv"},
        **{f"blocks.{i}.attn.o": RowwiseParallel() for i in range(2)},
        **{f"blocks.{i}.mlp.0": ColwiseParallel() for i in range(2)},
        **{f"blocks.{i}.mlp.2": RowwiseParallel() for i in range(2)},
        "embed": RowwiseParallel(input_layouts=Replicate()),  # weight Shard(0): rows of the vocabulary
    }
    for tied in (False, True):
        for impl in impls:
            name = f"fsdp-tp/{'tied' if tied else 'untied'}/{impl}"
            report.started(name)
            try:
                torch.manual_seed(0)
                ref = GPTToy(vocab, 32, 4, 2, tied, impl).to(device)
                torch.manual_seed(0)
                model = GPTToy(vocab, 32, 4, 2, tied, impl).to(device)
                parallelize_module(model, mesh["tp"], plan if tied else {**plan, "head": ColwiseParallel()})
                for block in model.blocks:
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(model, mesh=mesh["dp"])
                opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                for batch in data:
                    tokens, targets = batch[:, :-1], batch[:, 1:]
                    loss_ref = ref(tokens, targets)
                    opt_ref.zero_grad()
                    loss_ref.backward()
                    opt_ref.step()
                    mine = slice(rows * dp_rank, rows * (dp_rank + 1))
                    loss = model(tokens[mine], targets[mine])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    assert model.c_layout == ("DTensor", (Shard(0),)), model.c_layout  # the path under test
                    mean = loss.detach().clone()
                    dist.all_reduce(mean, group=mesh.get_group("dp"))
                    torch.testing.assert_close(mean / dp, loss_ref.detach(), rtol=1e-5, atol=1e-6)
                for (n, p), (n_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
                    assert n == n_ref and isinstance(p, DTensor), (n, n_ref, type(p))
                    torch.testing.assert_close(
                        p.full_tensor(), p_ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}"
                    )
                report.result(name, None)
            except Exception:  # noqa: BLE001 - reported per case
                report.result(name, traceback.format_exc(limit=-4))


def _fsdp_tp_cpu_worker(rank, world, report):
    _fsdp_tp_train(torch.device("cpu"), 2, ("torch",), report)


def test_fsdp2_tp_2d_mesh_cpu():
    _check_part(4, "fsdp-tp", 2)


# The parts of each world size's group, in the order its worker runs them.
PARTS = {
    2: (("mesh2", _mesh2_worker), ("fsdp2", _fsdp2_worker)),
    4: (("mesh4", _mesh4_worker), ("fsdp-tp", _fsdp_tp_cpu_worker)),
}


class _PrintReport:
    """report for _fsdp_tp_train under torchrun: prints each case, remembers failures."""

    def __init__(self):
        self.failed = []

    def started(self, name):
        pass

    def result(self, name, value):
        print(f"rank {dist.get_rank()}: {name}: {'ok' if value is None else value}", flush=True)
        if value is not None:
            self.failed.append(name)


def _torchrun_main():
    """torchrun entry (NCCL, one GPU per rank): FSDP2 + TP with tp=2, dp = world // 2."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl")
    report = _PrintReport()
    try:
        _fsdp_tp_train(torch.device("cuda"), 2, ("cce", "torch"), report)
    finally:
        dist.destroy_process_group()
    sys.exit(1 if report.failed else 0)


@pytest.mark.gpu
def test_gpu_fsdp2_tp_torchrun():
    """FSDP2 + TP (2-D mesh, tp=2) GPT-style toy, a few SGD steps, through torchrun on 2 GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(root)}
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.parallel.test_dtensor",
    ]
    proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(": ok") == 2 * 4, proc.stdout[-4000:]


if __name__ == "__main__":
    _torchrun_main()
