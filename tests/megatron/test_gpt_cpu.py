"""use_cce on a tiny megatron-core GPTModel, on CPU (gloo): loss and every gradient equal Megatron's.

A gloo group of 2 processes runs every layout in turn (a process that imports megatron-core
costs seconds), a group of 4 runs TP=2×PP=2 and TP=2×DP=2. Covered: TP=2 with and without
sequence parallelism; tied and untied embeddings; Megatron DDP with and without
overlap_grad_reduce, the CCE layer accumulating into main_grad or not; DP=2; PP=2 (tied embedding
gradients all-reduced by finalize_model_grads); use_cce before and after DDP wrapping; a padded
vocabulary; every loss option and impl; the logits path and cce_output_processor; misuse that
must raise on every rank. Each case trains one step of a model switched to CCE and of the same
model left on Megatron's ColumnParallelLinear + vocab_parallel_cross_entropy
(tests/megatron/gpt_setup.py), in fp32, and compares the masked per-token losses and all
gradients (main_grad under DDP): relative Frobenius error at most TIGHT for impls "torch" and
"exact", LOOSE for the others. Loss options that Megatron's GPT loss lacks (softcap, label
smoothing, z-loss, ignore_index) are compared against Megatron's gathered logits followed by
the same loss in plain PyTorch.

The Triton impls run under the Triton interpreter (TRITON_INTERPRET=1 from tests/conftest.py).
On CPU, megatron-core's pipeline schedules and optimizers need CUDA: the pipeline is driven by
hand, and the distributed optimizer is covered by the GPU tests (test_megatron_gpu.py).
`pytest -s` prints the measured errors per case.
"""

import dataclasses
import time
import traceback

import pytest
import torch

from tests.dist import spawn

pytestmark = pytest.mark.distributed

TIGHT = 2e-5  # impls "torch" and "exact": fp32 rounding only
LOOSE = 1e-4  # the other impls: blockwise fp32 sums in another order than the reference
OPTIONS = {"softcap": 3.0, "label_smoothing": 0.1, "z_loss": 1e-3}


def _tol(impl: str) -> float:
    return TIGHT if impl in ("torch", "exact") else LOOSE


@dataclasses.dataclass(frozen=True)
class Case:
    setup: object  # gpt_setup.Setup
    impls: tuple = ("cce_kahan_full_c",)
    options: tuple = ()  # use_cce options besides impl, (key, value) pairs
    reference: str = "megatron"  # or "options": gathered logits + the options in plain PyTorch


def _cases(world: int):
    from tests.megatron.gpt_setup import Setup

    if world == 4:
        return [
            Case(
                Setup(
                    "tp2-pp2-sp-tied-ddp-overlap",
                    tp=2,
                    pp=2,
                    sp=True,
                    tied=True,
                    ddp=True,
                    overlap=True,
                    microbatches=2,
                )
            ),
            Case(Setup("tp2-dp2-sp-ddp", tp=2, sp=True, ddp=True), impls=("exact",)),
        ]
    return [
        # Every impl through one model: use_cce is called again on it for each (idempotent switch).
        Case(Setup("tp2", tp=2), impls=("torch", "exact", "cce", "cce_kahan_full_c")),
        Case(Setup("tp2-sp-tied-ddp-overlap", tp=2, sp=True, tied=True, ddp=True, overlap=True)),
        Case(Setup("tp2-sp-ddp-nofusion", tp=2, sp=True, ddp=True, fusion=False), impls=("cce",)),
        # Vocabulary 130 padded to 136 (make_vocab_size_divisible_by=4 × tp=2); labels < 130.
        Case(
            Setup("tp2-sp-padded-vocab", tp=2, sp=True, vocab=136, label_vocab=130, ddp=True),
            impls=("exact", "cce_kahan_full_e"),
            options=(("make_vocab_size_divisible_by", 4),),
        ),
        Case(
            Setup("tp2-sp-options", tp=2, sp=True, ignore_frac=0.25),
            impls=("torch", "cce_kahan_full_c", "cce"),
            options=tuple(OPTIONS.items()),
            reference="options",
        ),
        Case(
            Setup("tp2-options-lean", tp=2, ignore_frac=0.25),
            impls=("cce_kahan",),
            options=(("logits_budget", "lean"), ("ignore_index", -1)),
            reference="options",
        ),
        Case(Setup("dp2-tied-ddp-overlap", tied=True, ddp=True, overlap=True), impls=("exact",)),
        Case(
            Setup("pp2-tied-ddp", pp=2, tied=True, ddp=True, microbatches=2),
            impls=("exact", "cce_kahan_full_c"),
        ),
        Case(Setup("pp2-untied-ddp-convert-after", pp=2, ddp=True, convert_after_ddp=True), impls=("cce",)),
    ]


def _options_dict(case: Case, impl: str) -> dict:
    return dict(case.options, impl=impl)


def _run_case(case: Case, device, report):
    from cce_parallel.megatron import use_cce
    from tests.megatron.gpt_setup import (
        build,
        compare,
        init_parallel,
        make_batches,
        options_reference,
        train_step,
    )

    s = case.setup
    init_parallel(s, device)
    ref = build(s, device)
    if case.reference == "options":
        options_reference(ref.gpt, **dict(case.options))
    ignore_index = dict(case.options).get("ignore_index", -100)
    batches = make_batches(s, device, ignore_index=ignore_index)
    ref_out = train_step(s, ref, batches, device)
    cce = build(s, device, cce=_options_dict(case, case.impls[0]))
    label_key = "cce_labels" if s.ignore_frac else "labels"
    for impl in case.impls:
        use_cce(cce.model, **_options_dict(case, impl))
        out = train_step(s, cce, batches, device, label_key=label_key)
        _check_switched(s, cce)
        errs = compare(out, ref_out)
        report.result(f"{s.name}/{impl}", {"errors": errs, "tol": _tol(impl)})


def _check_switched(s, built):
    """The last stage's output path is CCE; with DDP + fusion, ∇W went into main_grad."""
    from cce_parallel.megatron import CCEOutputLayer

    gpt = built.gpt
    if not gpt.post_process:
        return
    assert isinstance(gpt.output_layer, CCEOutputLayer), type(gpt.output_layer).__name__
    assert type(gpt).__name__ == "CCEGPTModel", type(gpt).__name__  # switching again adds no layer
    if s.ddp and s.fusion:
        weight = gpt.shared_embedding_or_output_weight() if s.tied else gpt.output_layer.weight
        assert weight.grad_added_to_main_grad, "the CCE layer did not accumulate into main_grad"


def _logits_and_processor(device, report):
    """Without labels the CCE model returns Megatron's logits; cce_output_processor matches the model."""
    from megatron.core import parallel_state

    from cce_parallel.megatron import cce_output_processor
    from tests.megatron.gpt_setup import Setup, build, init_parallel, make_batches, rel_err

    s = Setup("logits", tp=2, sp=True, tied=True)
    init_parallel(s, device)
    ref, cce = build(s, device), build(s, device, cce={"impl": "cce"})
    b = make_batches(s, device)[0]
    args = (b["tokens"], b["position_ids"], None)
    with torch.no_grad():
        for gather in (None, True):
            want = ref.model(*args, runtime_gather_output=gather)
            got = cce.model(*args, runtime_gather_output=gather)
            vocab = s.vocab if gather else s.vocab // s.tp
            assert got.shape == (s.mbs, s.seq, vocab), f"logits shape {tuple(got.shape)}"
            assert torch.equal(got, want), f"logits differ (runtime_gather_output={gather})"
        # The processor on the decoder's output equals the model's own loss.
        hidden = {}
        handle = cce.gpt.output_layer.register_forward_pre_hook(lambda m, a: hidden.setdefault("h", a[0]))
        loss = cce.model(*args, labels=b["labels"])
        handle.remove()
        assert hidden["h"].shape == (s.seq // s.tp, s.mbs, s.hidden), "the output layer saw no SP slice"
        processed = cce_output_processor(cce.model, hidden["h"], b["labels"])
        assert torch.equal(processed, loss), "cce_output_processor differs from the model's loss"
        logits = cce_output_processor(cce.model, hidden["h"])
        assert logits.shape == (s.mbs, s.seq, s.vocab // s.tp)
        # The reference loss from Megatron's own path, for the same hidden states.
        ref_loss = ref.model(*args, labels=b["labels"])
        assert rel_err(loss, ref_loss) < LOOSE, "CCE loss differs from Megatron's"
        # On a model not switched yet, the processor switches it (with its options) first.
        switched = cce_output_processor(ref.model, hidden["h"], b["labels"], impl="exact")
        assert type(ref.gpt.output_layer).__name__ == "CCEOutputLayer"
        assert ref.gpt.output_layer.cce_options.impl == "exact"
        assert rel_err(switched, ref_loss) < TIGHT, "cce_output_processor differs from Megatron's loss"
    report.result("logits", parallel_state.get_tensor_model_parallel_rank())


def _errors_on_every_rank(rank, device, report):
    """Misuse raises a clear error on every rank of the TP group; nobody hangs."""
    from cce_parallel.megatron import use_cce
    from tests.megatron.gpt_setup import Setup, build, init_parallel, make_batches

    s = Setup("errors", tp=2, sp=True)
    init_parallel(s, device)
    cce = build(s, device, cce={"impl": "torch"})
    b = make_batches(s, device)[0]
    layer = cce.gpt.output_layer
    hidden = torch.randn(s.seq // s.tp, s.mbs, s.hidden)
    messages = {}

    def expect(name, fn, *fragments):
        try:
            fn()
        except (ValueError, TypeError) as err:
            text = f"{err}"
            missing = [f for f in fragments if f not in text]
            messages[name] = f"missing {missing!r} in: {text}" if missing else "ok"
        else:
            messages[name] = "no error"

    # Labels [s, b] instead of [b, s] on rank 1 only: rank 1 names the problem, rank 0 is told.
    labels = b["labels"].t().contiguous() if rank == 1 else b["labels"]
    mine = ("[b, s]", "look like [s, b]") if rank == 1 else ("rank(s) [1] rejected",)
    expect("labels [s, b] on one rank", lambda: layer(hidden, labels=labels), *mine)
    # The full weight instead of this rank's shard (on every rank).
    full = torch.randn(s.vocab, s.hidden)
    expect("full weight", lambda: layer(hidden, weight=full, labels=b["labels"]), "full, unsharded", "shard")
    # A weight of the right shape that is not a vocabulary shard.
    replicated = torch.randn(s.vocab // s.tp, s.hidden)
    replicated.tensor_model_parallel = False
    expect(
        "replicated weight",
        lambda: layer(hidden, weight=replicated, labels=b["labels"]),
        "not a vocabulary shard",
    )
    # A vocabulary that make_vocab_size_divisible_by rules out: 128 is not a multiple of 3 × 2.
    expect(
        "vocab not divisible", lambda: use_cce(cce.gpt, make_vocab_size_divisible_by=3), "not divisible by 6"
    )
    # Labels outside the vocabulary.
    bad = b["labels"].clone()
    bad[0, 0] = s.vocab
    expect("label out of range", lambda: layer(hidden, labels=bad), f"found {s.vocab}")
    # Still usable afterwards (no collective left half-done).
    loss, _ = layer(hidden, labels=b["labels"])
    assert loss.shape == (s.mbs, s.seq)
    report.result("errors", messages)


def _worker(rank, world, report):
    import warnings

    warnings.filterwarnings("ignore")
    from tests.megatron.gpt_setup import install_cpu_shims

    install_cpu_shims()
    device = torch.device("cpu")
    for case in _cases(world):
        report.started(case.setup.name)
        t0 = time.monotonic()
        try:
            _run_case(case, device, report)
        except Exception:  # noqa: BLE001 - reported per case, the others still run
            report.result(f"{case.setup.name}/FAILED", traceback.format_exc())
        report.result(f"{case.setup.name}/seconds", time.monotonic() - t0)
    if world != 2:
        return
    for name, fn in (
        ("logits", lambda: _logits_and_processor(device, report)),
        ("errors", lambda: _errors_on_every_rank(rank, device, report)),
    ):
        report.started(name)
        try:
            fn()
        except Exception:  # noqa: BLE001
            report.result(f"{name}/FAILED", traceback.format_exc())


_OUTCOMES = {}


def _outcome(world: int):
    if world not in _OUTCOMES:
        _OUTCOMES[world] = spawn(_worker, world, timeout=600.0)
    return _OUTCOMES[world]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def outcome(request):
    return _outcome(request.param)


@pytest.fixture(scope="module")
def outcome2():
    return _outcome(2)


def test_group_ran(outcome):
    assert outcome.ok, outcome.describe()


def test_loss_and_grads_match_megatron(outcome):
    failures = []
    for name, per_rank in outcome.merged().items():
        if name.endswith("/FAILED"):
            failures += [f"{name} (rank {rank}):\n{value}" for rank, value in per_rank.items()]
        elif name.endswith("/seconds"):
            print(f"  {name:45s} {max(per_rank.values()):.1f} s")
        elif all(isinstance(v, dict) and "errors" in v for v in per_rank.values()):
            worst = {"loss": 0.0, "grad": 0.0, "grad_name": None}
            for rank, value in per_rank.items():
                e, tol = value["errors"], value["tol"]
                worst["loss"] = max(worst["loss"], e["loss"])
                if e["grad"] >= worst["grad"]:
                    worst["grad"], worst["grad_name"] = e["grad"], f"rank {rank} {e['grad_name']}"
                if not (e["loss"] <= tol and e["grad"] <= tol):
                    failures.append(f"{name} (rank {rank}): {e} > {tol}")
            print(f"  {name:45s} loss {worst['loss']:.1e}  grad {worst['grad']:.1e} ({worst['grad_name']})")
    assert not failures, "\n".join(failures[:8])


def test_errors_on_every_rank(outcome2):
    merged = outcome2.merged()
    assert "errors" in merged, merged.get("errors/FAILED", "the error checks did not run")
    bad = {(r, k): v for r, msgs in merged["errors"].items() for k, v in msgs.items() if v != "ok"}
    assert not bad, bad


def test_logits_path(outcome2):
    merged = outcome2.merged()
    assert "logits" in merged, merged.get("logits/FAILED", "the logits checks did not run")
