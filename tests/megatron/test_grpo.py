"""The worked GRPO step of docs/megatron.md, run as written on a GPTModel at TP=2 on CPU (gloo).

docs/megatron.md ("A GRPO step, worked") has three blocks marked as run here: (1) ``use_cce`` at
temperature 0.7, the old log-probs from a no-grad scoring forward with ``return_log_probs``, and
group-normalized advantages; (2) the clipped-ratio policy loss plus an entropy bonus over the
response tokens, from the log-probs and entropy the model returns, and its backward; (3) the
on-policy update folded into the forward, advantages as ``loss_weights`` and the entropy bonus as
``entropy_weights``. The worker executes them
in that order on a tiny GPTModel (2 prompts x 3 samples of 16 tokens, a response mask of varying
lengths, one reward per sequence), with and without sequence parallelism, and wrapped in
Megatron's DDP with the CCE layer adding its weight gradient into main_grad (gradient-accumulation
fusion, as in training). Between (1) and (2) it moves the weights a little, as earlier updates
would, so that the ratio leaves the clip range on some tokens.

The reference is the same model, with the same weights, through Megatron's own logits path: the
forward without labels gives the output layer's logits [b, s, V/tp], gathered over the vocabulary
shards (differentiable), then float, / T, log_softmax, the labels' entries and the entropy; the
doc's ``grpo_loss`` on them, and its backward. Compared within fp32 error (1e-5 relative): the old
log-probs, the step's loss, log-probs and entropy, and every parameter's gradient; the folded
update's per-token loss against weights · -log-prob + entropy_weights · entropy from the reference,
and its gradients against the objective's at ratio 1 with the entropy bonus. Also the paths the
layer took (the update: the lean path, no gradients made in the forward; the folded one: made in
the forward, only scaled). The test checks its own power: the reference without the temperature
is far from the model's log-probs, and the objective's gradient without the entropy bonus far from
the folded one.

Then what ``return_log_probs`` refuses, each on both ranks, and ``cce_output_processor``'s dict.

One spawned group of 2 processes; the tiny GPT of gpt_setup.py (2 layers, hidden 32, a 128-token
vocabulary), impl cce_kahan_full_c under the Triton interpreter.
"""

import re
import time
import traceback
from pathlib import Path

import pytest
import torch

from tests.dist import spawn

pytestmark = pytest.mark.distributed

DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"
MARKER = "<!-- tests/megatron/test_grpo.py runs this block -->"
T = 0.7  # the temperature the doc's block switches the model to
PROMPTS, SAMPLES, PROMPT_LEN = 2, 3, 5
DRIFT = 0.2  # the weights' move between scoring and the update (clips some tokens' ratios)
CASES = {"tp2": (False, False), "tp2-sp": (True, False), "tp2-sp-ddp": (True, True)}  # (sp, ddp)
TOL = 1e-5  # fp32, every gradient of a 2-layer GPT (as tests/megatron/test_loss_weights.py)


def doc_blocks() -> list:
    """The python blocks of docs/megatron.md marked as run here, in order (compiled)."""
    blocks = re.findall(re.escape(MARKER) + r"\n```python\n(.*?)\n```", DOC.read_text(), re.DOTALL)
    return [compile(code, f"{DOC.name} block {i + 1}", "exec") for i, code in enumerate(blocks)]


def grpo_batch(vocab: int, seq: int, seed: int = 0) -> dict:
    """The names the doc's blocks use: PROMPTS prompts with SAMPLES responses each, consecutive
    (tokens [b, seq], each prompt's first PROMPT_LEN tokens shared by its samples), position_ids,
    labels [b, seq], response_mask [b, seq] (1.0 on the labels that are response tokens), rewards
    [b] and samples. The same on every rank."""
    g = torch.Generator().manual_seed(seed)
    b = PROMPTS * SAMPLES
    tokens = torch.randint(0, vocab, (b, seq + 1), generator=g)
    prompts = torch.randint(0, vocab, (PROMPTS, 1, PROMPT_LEN), generator=g)
    tokens[:, :PROMPT_LEN] = prompts.expand(-1, SAMPLES, -1).reshape(b, PROMPT_LEN)
    lengths = torch.randint(4, seq + 1 - PROMPT_LEN, (b,), generator=g)  # response tokens, then padding
    pos = torch.arange(seq)
    # Label t is token t + 1: the response's tokens PROMPT_LEN .. PROMPT_LEN + n - 1 are the labels
    # at PROMPT_LEN - 1 .. PROMPT_LEN + n - 2.
    response_mask = ((pos >= PROMPT_LEN - 1) & (pos < PROMPT_LEN - 1 + lengths[:, None])).float()
    return {
        "tokens": tokens[:, :-1],
        "position_ids": pos.expand(b, -1),
        "labels": tokens[:, 1:],
        "response_mask": response_mask,
        "rewards": torch.rand(b, generator=g),
        "samples": SAMPLES,
    }


def _megatron_log_probs(model, gpt, ns, temperature=T):
    """Megatron's own path: the logits [b, s, V/tp], gathered over the vocabulary shards (the
    gather's backward splits the gradient back), float, / T -> (log-probs, entropy) [b, s], 0 off
    the response mask, as the CCE model returns them."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    logits = model(ns["tokens"], ns["position_ids"], None)  # no labels: Megatron's logits
    z = gather_from_tensor_model_parallel_region(logits, group=gpt.tp_group).float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    log_probs = logp.gather(-1, ns["labels"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    mask = ns["response_mask"]
    return log_probs * mask, entropy * mask


def _grads(gpt, ddp: bool) -> dict:
    """The parameters' gradients by name: main_grad under DDP (where the CCE layer adds its own)."""
    grads = {n: getattr(p, "main_grad", None) if ddp else p.grad for n, p in gpt.named_parameters()}
    return {n: g.detach().clone() for n, g in grads.items() if g is not None}


def _zero_grads(model, gpt, ddp: bool):
    if ddp:
        model.zero_grad_buffer()
    for p in gpt.parameters():
        p.grad = None


def _grad_errors(grads: dict, ref: dict) -> dict:
    from tests.megatron.gpt_setup import rel_err

    errors = {n: rel_err(grads[n], g) for n, g in ref.items() if n in grads}
    worst = max(errors, key=errors.get)
    same = sorted(grads) == sorted(ref) and bool(ref)
    return {"same_params": same, "grad": errors[worst], "grad_name": worst}


def _case(name: str, sp: bool, ddp: bool, report):
    """The doc's blocks on a plain GPTModel (block 1 switches it), against Megatron's logits.

    ddp: the model is wrapped in Megatron's DDP and the CCE layer adds its weight gradient into
    main_grad (gradient-accumulation fusion, as in training); Megatron's layer, which would need a
    CUDA kernel for that on CPU, gives its gradient to DDP's hook instead."""
    from megatron.core import parallel_state

    from tests.megatron.gpt_setup import Setup, build, init_parallel, rel_err

    s = Setup(name, tp=2, sp=sp, ddp=ddp, mbs=PROMPTS * SAMPLES)
    init_parallel(s, torch.device("cpu"))
    built = build(s, torch.device("cpu"))
    model, gpt = built.model, built.gpt
    scoring, update, folded = doc_blocks()
    ns = {"model": model, **grpo_batch(s.vocab, s.seq)}
    mask = ns["response_mask"]
    out = {}

    exec(scoring, ns)  # use_cce, the old log-probs (no grad), the advantages
    layer = gpt.output_layer
    with torch.no_grad():
        ref_old, _ = _megatron_log_probs(model, gpt, ns)
        untempered, _ = _megatron_log_probs(model, gpt, ns, temperature=1.0)
    out["keys"] = sorted(ns["old"])
    out["old"] = rel_err(ns["old_log_probs"], ref_old)
    out["untempered"] = rel_err(ns["old_log_probs"], untempered)  # the test's power: far above TOL

    # Earlier updates moved the policy: the same move on every rank (each TP shard, each replica).
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(DRIFT * p.abs().mean() * torch.randn(p.shape, generator=g))
    layer.reset_cce_state()

    def reference(old_log_probs, **kwargs):
        """Megatron's logits -> the doc's grpo_loss, backward: (log-probs, entropy, loss, grads)."""
        _zero_grads(model, gpt, ddp)
        layer.gradient_accumulation_fusion = False
        try:
            log_probs, entropy = _megatron_log_probs(model, gpt, ns)
            old = log_probs.detach() if old_log_probs is None else old_log_probs
            loss = ns["grpo_loss"](log_probs, entropy, old, ns["advantages"], mask, **kwargs)
            loss.backward()
        finally:
            layer.gradient_accumulation_fusion = ddp
        return log_probs.detach(), entropy.detach(), loss.detach(), _grads(gpt, ddp)

    _zero_grads(model, gpt, ddp)
    layer.gradient_accumulation_fusion = ddp
    exec(update, ns)  # the GRPO loss from the returned log-probs and entropy, backward
    grads, paths = _grads(gpt, ddp), dict(layer.cce_state.paths)
    fused = getattr(layer.weight, "grad_added_to_main_grad", False)  # DDP's zero_grad_buffer clears it
    ref_lp, ref_ent, ref_loss, ref_grads = reference(ns["old_log_probs"])
    got = ns["out"]
    ratio = torch.exp(ref_lp - ns["old_log_probs"])
    out.update(
        loss=rel_err(ns["loss"].detach(), ref_loss),
        log_probs=rel_err(got["log_probs"].detach(), ref_lp),
        entropy=rel_err(got["entropy"].detach(), ref_ent),
        masked_zero=bool((got["log_probs"][mask == 0] == 0).all() and (got["entropy"][mask == 0] == 0).all()),
        clipped=int((((ratio - 1).abs() > 0.2) & (mask > 0)).sum()),
        paths=paths,
        fused=fused,
        **_grad_errors(grads, ref_grads),
    )
    report.result(f"{name}/step", out)

    # On-policy, folded: the same layer state (the update above taught it nothing that changes the path).
    _zero_grads(model, gpt, ddp)
    before = layer.cce_state.paths.copy()
    exec(folded, ns)
    grads, paths = _grads(gpt, ddp), dict(layer.cce_state.paths - before)
    fused = getattr(layer.weight, "grad_added_to_main_grad", False)
    ref_lp, ref_ent, _, ref_grads = reference(None)  # ratio 1, with grpo_loss's entropy bonus
    *_, no_bonus = reference(None, entropy_coef=0.0)
    expected = -ns["weights"] * ref_lp + ns["entropy_weights"] * ref_ent
    report.result(f"{name}/folded", {
        "paths": paths,
        "fused": fused,
        "loss": rel_err(ns["losses"].detach(), expected),
        "no_bonus": _grad_errors(grads, no_bonus)["grad"],  # the test's power: far above TOL
        **_grad_errors(grads, ref_grads),
    })
    parallel_state.destroy_model_parallel()


def _mtp_model(setup):
    """The tiny GPT with one multi-token-prediction layer, switched by use_cce (as test_mtp.py)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_model import GPTModel

    from cce_parallel.megatron import local_gpt_block_spec, use_cce
    from cce_parallel.train.gpt import mtp_block_spec
    from tests.megatron.gpt_setup import make_config

    config = dataclasses.replace(make_config(setup), mtp_num_layers=1)
    block = local_gpt_block_spec(config)
    gpt = GPTModel(
        config, block, vocab_size=setup.vocab, max_sequence_length=setup.seq,
        mtp_block_spec=mtp_block_spec(config, block, use_te=False),
    )
    return use_cce(gpt, impl="cce_kahan_full_c", temperature=T)


def _misuse(report):
    """What return_log_probs refuses, and the processor's dict; at TP=2 without SP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cce_parallel.megatron import cce_output_processor, use_cce
    from tests.megatron.gpt_setup import Setup, build, init_parallel

    s = Setup("grpo-misuse", tp=2, mbs=PROMPTS * SAMPLES)
    init_parallel(s, torch.device("cpu"))
    options = {"impl": "cce_kahan_full_c", "temperature": T}
    cce, plain = build(s, torch.device("cpu"), cce=options), build(s, torch.device("cpu"))
    batch = grpo_batch(s.vocab, s.seq)
    args = (batch["tokens"], batch["position_ids"], None)
    labels, mask = batch["labels"], batch["response_mask"]

    report.started("misuse-processor")
    with torch.no_grad():
        hidden = {}
        handle = cce.gpt.output_layer.register_forward_pre_hook(lambda m, a: hidden.setdefault("h", a[0]))
        from_model = cce.model(*args, labels=labels, loss_mask=mask, return_log_probs=True)
        handle.remove()
        processed = cce_output_processor(
            cce.model, hidden["h"], labels, loss_mask=mask, return_log_probs=True
        )
    report.result("misuse-processor", sorted(processed) == ["entropy", "log_probs"] and all(
        torch.equal(processed[k], from_model[k]) for k in processed
    ))

    def z_loss():
        use_cce(cce.model, **options, z_loss=1e-4)
        try:
            return cce.model(*args, labels=labels, return_log_probs=True)
        finally:
            use_cce(cce.model, **options)

    calls = {
        "no-labels": lambda: cce.model(*args, return_log_probs=True),
        "loss-weights": lambda: cce.model(*args, labels=labels, loss_weights=mask, return_log_probs=True),
        "entropy-weights": lambda: cce.model(*args, labels=labels, entropy_weights=-0.01, return_log_probs=True),
        "not-a-bool": lambda: cce.model(*args, labels=labels, return_log_probs=1),
        "z-loss": z_loss,
        "not-switched": lambda: plain.model(*args, labels=labels, return_log_probs=True),
        "mtp": lambda: _mtp_model(s)(*args, labels=labels, return_log_probs=True),
    }
    for name, call in calls.items():
        report.started(f"misuse-{name}")
        try:
            call()
            outcome = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = (type(exc).__name__, str(exc))
        report.result(f"misuse-{name}", outcome)
        dist.barrier()  # every rank raised alike: none is left inside a collective
    parallel_state.destroy_model_parallel()


def _worker(rank, world, report):
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's warnings about missing apex / TE
    from tests.megatron.gpt_setup import install_cpu_shims

    install_cpu_shims()
    for name, (sp, ddp) in CASES.items():
        report.started(name)
        t0 = time.monotonic()
        try:
            _case(name, sp, ddp, report)
        except Exception:  # noqa: BLE001 - reported, the parent fails the test with it
            report.result(name, traceback.format_exc())
        report.result(f"{name}/seconds", time.monotonic() - t0)
    t0 = time.monotonic()
    _misuse(report)
    report.result("misuse/seconds", time.monotonic() - t0)


_OUTCOME = []


def _outcome():
    if not _OUTCOME:
        _OUTCOME.append(spawn(_worker, 2, timeout=300.0, collective_timeout=20.0, grace=5.0))
    return _OUTCOME[0]


def _per_rank(name: str, case: str | None = None) -> dict:
    """{rank: what the worker reported as `name`}; a traceback reported for `case` fails first."""
    outcome = _outcome()
    merged = outcome.merged()
    for rank, failure in merged.get(case, {}).items():
        assert not isinstance(failure, str), f"rank {rank}:\n{failure}"
    per_rank = merged.get(name, {})
    assert sorted(per_rank) == [0, 1], f"{name}: not every rank reported\n{outcome.describe()}"
    return per_rank


def test_doc_has_the_three_blocks():
    assert len(doc_blocks()) == 3, f"{DOC}: expected the scoring, update and folded blocks after {MARKER!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_step_matches_megatron_logits(case):
    for rank, r in _per_rank(f"{case}/step", case).items():
        print(f"  rank {rank}: {r}")
        assert r["keys"] == ["entropy", "log_probs"], r
        assert r["old"] <= TOL, r
        assert r["untempered"] > 100 * TOL, r  # without the temperature the comparison would fail
        assert r["clipped"] > 0, r  # the clip is exercised
        assert r["loss"] <= TOL and r["log_probs"] <= TOL and r["entropy"] <= TOL, r
        assert r["masked_zero"] and r["same_params"], r
        assert r["paths"] == {"lean": 2}, r  # no gradients made in the forward to be recomputed
        assert r["fused"] == CASES[case][1], r  # under DDP the layer added ∇W into main_grad itself
        assert r["grad"] <= TOL, r


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_on_policy_step_folded_into_loss_and_entropy_weights(case):
    for rank, r in _per_rank(f"{case}/folded", case).items():
        print(f"  rank {rank}: {r}")
        assert r["same_params"] and r["grad"] <= TOL and r["loss"] <= TOL, r
        assert r["no_bonus"] > 100 * TOL, r  # the entropy bonus is in the folded gradient
        assert r["paths"] == {"one_pass": 1, "scaled": 1}, r  # made in the forward, only scaled
        assert r["fused"] == CASES[case][1], r


def test_processor_returns_the_models_log_probs():
    assert _outcome().ok, _outcome().describe()
    assert all(_per_rank("misuse-processor").values())


@pytest.mark.parametrize(
    "name, kind, pattern",
    [
        ("no-labels", "ValueError", r"return_log_probs returns the labels' log-probs, .* \(it has no labels\)"),
        ("loss-weights", "ValueError", r"return_log_probs and loss_weights together"),
        ("entropy-weights", "ValueError", r"return_log_probs and entropy_weights together"),
        ("not-a-bool", "TypeError", r"return_log_probs must be a bool, got 1"),
        ("z-loss", "ValueError", r"-log p\(label\) alone.*label_smoothing=0.0, z_loss=0.0001"),
        ("not-switched", "TypeError", r"unexpected keyword argument 'return_log_probs'"),
        ("mtp", "ValueError", r"not supported with multi-token prediction \(mtp_num_layers=1\)"),
    ],
)
def test_return_log_probs_refuses_misuse(name, kind, pattern):
    for rank, (got, msg) in _per_rank(f"misuse-{name}").items():
        assert got == kind and re.search(pattern, msg), f"rank {rank}: {got}: {msg}"
