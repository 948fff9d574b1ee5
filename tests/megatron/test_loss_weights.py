"""Per-token weights known in the forward (``loss_weights``, ``entropy_weights``), at TP=2 on CPU (gloo).

- The layer: ``CCEOutputLayer(hidden, labels=labels, loss_weights=w)`` against megatron-core's own
  per-token loss times w (``ColumnParallelLinear`` then ``vocab_parallel_cross_entropy``, the same
  layer object before it is converted), with and without sequence parallelism, for signed random
  weights and a 0/1 mask as weights: the loss and ∇hidden, ∇weight in fp32 within 1e-6; a weights
  tensor that requires grad gets the per-token loss; with ``entropy_weights`` (a number) too,
  against w · Megatron's loss + h · the entropy of its gathered logits. The summed weighted loss
  takes the one-pass path with its gradients only scaled in the backward (the layer's
  ``cce_state.paths``).
- The model: ``model(..., labels=labels, loss_weights=w)`` on a ``use_cce`` GPTModel against
  Megatron's model's per-token loss times w (every gradient), with ``loss_mask`` too, and
  ``cce_output_processor(..., loss_weights=w)`` (and ``entropy_weights``); weights or entropy
  weights without labels, or given to a model that is not switched, are rejected.
- Bad weights on ONE rank only (shape, transposed, dtype, device, not a tensor; entropy weights
  transposed or not finite) raise a
  ValueError / TypeError on every rank, with and without sequence parallelism; the group is usable
  afterwards (collectives time out after 20 s, so a rank left behind fails rather than hangs).

One spawned group of 2 processes; hidden 16, a 32-token vocabulary (two shards of 16 rows), 8 x 2
tokens for the layer, the tiny GPT of gpt_setup.py for the model.
"""

import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.dist import spawn

pytestmark = pytest.mark.distributed

S, B, H, V = 8, 2, 16, 32  # S != B: a transposed [s, b] tensor is told apart from [b, s]
LAYER_TOL = 1e-6  # fp32 against Megatron's fp32 loss (blockwise sums in another order)
MODEL_TOL = 1e-5  # every gradient of a 2-layer GPT (as tests/megatron/test_loss_mask.py)
WEIGHTS = ("signed", "mask", "entropy")  # entropy: signed weights and entropy_weights=ENTROPY
ENTROPY = -0.3

# name -> (sequence_parallel, {rank: how that rank's weights are wrong})
BAD = {
    "shape": (False, {1: "shape"}),
    "transposed-sp": (True, {0: "transposed"}),
    "dtype": (False, {0: "dtype"}),
    "device-sp": (True, {1: "device"}),
    "not-a-tensor": (False, {1: "list"}),
    "entropy-transposed-sp": (True, {0: "entropy-transposed"}),
    "entropy-nan": (False, {1: "entropy-nan"}),
}
BAD_MESSAGES = {  # (exception type, message pattern) on the rank with the bad weights
    "shape": ("ValueError", r"loss_weights must be shaped like the labels \[b, s\] = \(2, 8\); got \(2, 7\)"),
    "transposed": ("ValueError", r"got \(8, 2\) \(they look like \[s, b\]"),
    "dtype": ("TypeError", r"loss_weights must be a floating-point tensor, got dtype torch.int64"),
    "device": ("ValueError", r"loss_weights are on meta, but the hidden states are on cpu"),
    "list": ("TypeError", r"loss_weights must be a torch.Tensor or None, got list"),
    "entropy-transposed": ("ValueError", r"entropy_weights must be shaped like the labels .* look like \[s, b\]"),
    "entropy-nan": ("ValueError", r"entropy_weights must be finite, got nan"),
}
PEER_MESSAGE = r"tensor-parallel rank\(s\) \[{}\] rejected their inputs"


def _weights(kind: str, generator) -> torch.Tensor:
    if kind in ("signed", "entropy"):
        return torch.randn(B, S, generator=generator)
    mask = (torch.rand(B, S, generator=generator) > 0.4).float()
    mask[0, 0] = 0.0
    return mask


def _inputs(seed: int, rank: int, world: int, sp: bool):
    """hidden [S, B, H] (this rank's slice under SP, a leaf), labels [B, S]: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    if sp:
        hidden = hidden[rank * S // world:(rank + 1) * S // world]
    return hidden.clone().requires_grad_(), labels, g


def _column_parallel(sp: bool, group):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config = ModelParallelConfig(
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        tensor_model_parallel_size=2,
        sequence_parallel=sp,
    )
    torch.manual_seed(3)  # the same master weight on every rank, each taking its shard
    init = lambda w: torch.nn.init.normal_(w, std=0.3)  # noqa: E731
    return ColumnParallelLinear(H, V, config=config, init_method=init, bias=False, tp_group=group)


def _layer_case(rank, world, sp: bool, kind: str, weights_grad: bool) -> dict:
    """Megatron's path, then the same layer converted to CCE: errors and the paths taken."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from cce_parallel.megatron import CCEOptions, CCEOutputLayer
    from tests.megatron.gpt_setup import rel_err

    group = parallel_state.get_tensor_model_parallel_group()
    layer = _column_parallel(sp, group)
    h = ENTROPY if kind == "entropy" else None
    results = []
    for cce in (False, True):
        hidden, labels, g = _inputs(7, rank, world, sp)
        w = _weights(kind, g).requires_grad_(weights_grad)
        layer.weight.grad = None
        if cce:
            layer = CCEOutputLayer.convert(layer, CCEOptions(impl="cce_kahan_full_c"))
            loss, _ = layer(hidden, labels=labels, loss_weights=w, entropy_weights=h)
        else:
            logits, _ = layer(hidden)  # [s, b, V/tp]
            # (a copy: megatron-core's cross-entropy overwrites the logits it gets with their exp)
            loss = vocab_parallel_cross_entropy(logits.float().clone(), labels.t().contiguous()).t() * w  # [b, s]
            if h is not None:  # the entropy of the gathered logits (the gather's backward splits)
                logp = torch.log_softmax(gather_from_tensor_model_parallel_region(logits, group=group).float(), -1)
                loss = loss + h * -(logp.exp() * logp).sum(-1).t()
        loss.sum().backward()
        results.append((loss.detach(), hidden.grad, layer.weight.grad, w.grad))
    (ref, ref_dh, ref_dw, ref_dwt), (out, dh, dw, dwt) = results
    r = {
        "shape": tuple(out.shape),
        "loss": rel_err(out, ref),
        "dhidden": rel_err(dh, ref_dh),
        "dweight": rel_err(dw, ref_dw),
        "paths": dict(layer.cce_state.paths),
        "masked_zero": kind != "mask" or bool((out[w.detach() == 0] == 0).all()),
    }
    if weights_grad:
        r["dweights"] = rel_err(dwt, ref_dwt)
    return r


def _model_cases(report):
    from megatron.core import parallel_state

    from cce_parallel.megatron import cce_output_processor
    from tests.megatron.gpt_setup import Setup, build, init_parallel, make_batches, rel_err

    s = Setup("loss-weights", tp=2, sp=True, ignore_frac=0.25)
    init_parallel(s, torch.device("cpu"))
    batch = make_batches(s, torch.device("cpu"))[0]
    args = (batch["tokens"], batch["position_ids"], None)
    labels, mask = batch["labels"], batch["loss_mask"]
    w = torch.randn(s.mbs, s.seq, generator=torch.Generator().manual_seed(11))
    ref, cce = build(s, torch.device("cpu")), build(s, torch.device("cpu"), cce={"impl": "cce_kahan_full_c"})

    def step(built, weighted, **kwargs):
        for p in built.gpt.parameters():
            p.grad = None
        if weighted:
            loss = built.model(*args, labels=labels, loss_weights=w, **kwargs)
        else:
            loss = built.model(*args, labels=labels) * w * kwargs.get("loss_mask", 1.0)
        loss.sum().backward()
        grads = {n: p.grad.clone() for n, p in built.gpt.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    def compare(name, **kwargs):
        report.started(name)
        (ref_loss, ref_grads), (loss, grads) = step(ref, False, **kwargs), step(cce, True, **kwargs)
        layer = cce.gpt.output_layer
        report.result(name, {
            "loss": rel_err(loss, ref_loss),
            "grad": max(rel_err(grads[n], g) for n, g in ref_grads.items()),
            "same_params": sorted(grads) == sorted(ref_grads),
            "left_over": layer._cce_pending_weights is not None or cce.gpt._cce_loss_weights is not None,
        })
        return loss

    compare("model")
    masked = compare("model-loss-mask", loss_mask=mask)
    report.result("model-loss-mask/masked-zero", bool((masked[mask == 0] == 0).all()))

    report.started("model-processor")
    with torch.no_grad():
        hidden = {}
        handle = cce.gpt.output_layer.register_forward_pre_hook(lambda m, a: hidden.setdefault("h", a[0]))
        from_model = cce.model(*args, labels=labels, loss_weights=w)
        handle.remove()
        processed = cce_output_processor(cce.model, hidden["h"], labels, loss_weights=w)
    report.result("model-processor", torch.equal(processed, from_model))

    report.started("model-processor-entropy")
    with torch.no_grad():
        from_model = cce.model(*args, labels=labels, loss_weights=w, entropy_weights=ENTROPY)
        processed = cce_output_processor(cce.model, hidden["h"], labels, loss_weights=w, entropy_weights=ENTROPY)
        plain = cce.model(*args, labels=labels, loss_weights=w)
    kept = labels != -100
    report.result("model-processor-entropy", torch.equal(processed, from_model) and bool(
        ((from_model - plain)[kept] < 0).all() and ((from_model - plain)[~kept] == 0).all()
    ))

    for name, call in (
        ("model-no-labels", lambda: cce.model(*args, loss_weights=w)),
        ("model-transposed", lambda: cce.model(*args, labels=labels, loss_weights=w.t())),
        ("model-not-switched", lambda: ref.model(*args, labels=labels, loss_weights=w)),
        ("model-entropy-no-labels", lambda: cce.model(*args, entropy_weights=ENTROPY)),
        ("model-entropy-not-switched", lambda: ref.model(*args, labels=labels, entropy_weights=ENTROPY)),
    ):
        report.started(name)
        try:
            call()
            report.result(name, ("no error", ""))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            report.result(name, (type(exc).__name__, str(exc)))
    parallel_state.destroy_model_parallel()


def _bad(how: str, w: torch.Tensor):
    if how == "entropy-transposed":
        return w.t()
    if how == "entropy-nan":
        return float("nan")
    if how == "shape":
        return w[:, :-1]
    if how == "transposed":
        return w.t()
    if how == "dtype":
        return w.long()
    if how == "device":
        return w.to("meta")
    return w.tolist()


def _error_cases(rank, world, report):
    from megatron.core import parallel_state

    from cce_parallel.megatron import CCEOptions, CCEOutputLayer

    group = parallel_state.get_tensor_model_parallel_group()
    layers = {
        sp: CCEOutputLayer.convert(_column_parallel(sp, group), CCEOptions(impl="cce_kahan_full_c"))
        for sp in (False, True)
    }
    for name, (sp, bad) in [*BAD.items(), ("fine-after", (True, {}))]:
        report.started(name)
        hidden, labels, g = _inputs(5, rank, world, sp)
        w, h = _weights("signed", g), None
        if rank in bad and bad[rank].startswith("entropy-"):
            h = _bad(bad[rank], w)
        elif rank in bad:
            w = _bad(bad[rank], w)
        try:
            loss, _ = layers[sp](hidden, labels=labels, loss_weights=w, entropy_weights=h)
            loss.sum().backward()
            outcome = ("no error", tuple(loss.shape))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = (type(exc).__name__, str(exc))
        report.result(name, outcome)
        dist.barrier(group)  # the next collective: a rank left behind times out here


def _worker(rank, world, report):
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's warnings about missing apex / TE
    from megatron.core import parallel_state

    from tests.megatron.gpt_setup import install_cpu_shims

    install_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for sp in (False, True):
        for kind in WEIGHTS:
            name = f"layer-{kind}{'-sp' if sp else ''}"
            report.started(name)
            t0 = time.monotonic()
            try:
                report.result(name, _layer_case(rank, world, sp, kind, weights_grad=False))
            except Exception:  # noqa: BLE001 - reported, the parent fails the test with it
                report.result(name, traceback.format_exc())
            report.result(f"{name}/seconds", time.monotonic() - t0)
    report.started("layer-weights-grad")
    report.result("layer-weights-grad", _layer_case(rank, world, False, "signed", weights_grad=True))
    _error_cases(rank, world, report)
    parallel_state.destroy_model_parallel()
    _model_cases(report)


_OUTCOME = []


def _outcome():
    if not _OUTCOME:
        _OUTCOME.append(spawn(_worker, 2, timeout=300.0, collective_timeout=20.0, grace=5.0))
    return _OUTCOME[0]


def _per_rank(name: str) -> dict:
    outcome = _outcome()
    per_rank = outcome.merged().get(name, {})
    assert sorted(per_rank) == [0, 1], f"{name}: not every rank reported\n{outcome.describe()}"
    return per_rank


@pytest.mark.interpreter
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("kind", WEIGHTS)
def test_layer_weighted_loss_matches_megatron(kind, sp):
    name = f"layer-{kind}{'-sp' if sp else ''}"
    for rank, r in _per_rank(name).items():
        assert isinstance(r, dict), f"rank {rank}:\n{r}"
        print(f"  rank {rank}: {r}")
        assert r["shape"] == (B, S), r
        assert r["loss"] <= LAYER_TOL and r["dhidden"] <= LAYER_TOL and r["dweight"] <= LAYER_TOL, r
        assert r["masked_zero"], r
        # Weights known in the forward: gradients made in the forward, only scaled in the backward.
        assert r["paths"] == {"one_pass": 1, "scaled": 1}, r


def test_layer_weights_that_require_grad_get_the_per_token_loss():
    for rank, r in _per_rank("layer-weights-grad").items():
        assert r["loss"] <= LAYER_TOL and r["dhidden"] <= LAYER_TOL and r["dweight"] <= LAYER_TOL, r
        assert r["dweights"] <= LAYER_TOL, r


@pytest.mark.parametrize("name", ["model", "model-loss-mask"])
def test_model_loss_weights_match_megatron(name):
    for rank, r in _per_rank(name).items():
        print(f"  rank {rank}: {r}")
        assert r["loss"] <= MODEL_TOL and r["grad"] <= MODEL_TOL and r["same_params"], r
        assert not r["left_over"], f"rank {rank}: the weights stayed routed after the forward: {r}"
    if name == "model-loss-mask":
        assert all(_per_rank("model-loss-mask/masked-zero").values())


def test_processor_takes_loss_weights():
    assert all(_per_rank("model-processor").values())
    assert all(_per_rank("model-processor-entropy").values())


@pytest.mark.parametrize(
    "name, kind, pattern",
    [
        ("model-no-labels", "ValueError", r"loss_weights weight the per-token loss.*it has no labels"),
        ("model-transposed", "ValueError", r"got \(16, 2\) \(they look like \[s, b\]"),
        ("model-not-switched", "TypeError", r"unexpected keyword argument 'loss_weights'"),
        ("model-entropy-no-labels", "ValueError", r"entropy_weights add each token's entropy.*it has no labels"),
        ("model-entropy-not-switched", "TypeError", r"unexpected keyword argument 'entropy_weights'"),
    ],
)
def test_model_rejects_misused_loss_weights(name, kind, pattern):
    for rank, (got, msg) in _per_rank(name).items():
        assert got == kind and re.search(pattern, msg), f"rank {rank}: {got}: {msg}"


@pytest.mark.parametrize("name", list(BAD))
def test_bad_weights_on_one_rank_raise_on_every_rank(name):
    _, bad = BAD[name]
    problems = []
    for rank, (got, msg) in _per_rank(name).items():
        # The rank with bad weights names them; the other names that rank.
        peer = ("ValueError", PEER_MESSAGE.format(min(bad)))
        kind, pattern = BAD_MESSAGES[bad[rank]] if rank in bad else peer
        if got != kind or not re.search(pattern, msg):
            problems.append(f"rank {rank}: expected {kind} matching {pattern!r}, got {got}: {msg}")
    if problems:
        pytest.fail(f"{name}:\n" + "\n".join(problems) + "\n" + _outcome().describe(), pytrace=False)


def test_layer_usable_after_bad_weights():
    assert _outcome().ok, _outcome().describe()
    assert all(r == ("no error", (B, S)) for r in _per_rank("fine-after").values())
