"""Multi-token prediction through CCE: a GPTModel with ``mtp_num_layers`` switched by ``use_cce``
gives megatron-core's own MTP losses and every gradient.

megatron-core's MTP (the DeepSeek-V3 recipe) calls the output layer once per depth k = 1 .. n on
the MTP block's hidden states, takes the cross-entropy with the labels and the loss_mask rolled k
times, its masked mean times ``mtp_loss_scaling_factor / n``, and attaches it to the graph
(MTPLossAutoScaler); then the main head. With CCE each depth's loss is the output layer's own,
with the rolled labels (the rolled mask folded in) routed to it ahead of the main head's, and its
own UpstreamState (``output_layer.mtp_cce_states[k]``).

Each case builds the same model twice (same seed, ``use_cpu_initialization``), once left on
Megatron's ColumnParallelLinear + vocab_parallel_cross_entropy and once switched to CCE, trains
one step in fp32 the way Megatron-LM's pretrain_gpt does (the model gets ``loss_mask``; the
schedule's MTP loss scale set as megatron-core's schedule sets it) and compares: the masked main
loss per token, each depth's logged MTP loss (``MTPLossLoggingHelper.tracker``) and every
parameter's gradient (main_grad under DDP), relative error at most TOL. Also checked: every
call took the one-pass path and no backward recomputed (each depth's upstream gradient is one
number over its kept tokens), each depth learned in its own state and the main head's state saw
only the main head's calls, loss_weights and entropy_weights weight the main head alone, and the
layer raises if
the calls do not use every label routed to it.

One gloo group of 2 processes: TP=2 with and without sequence parallelism, a tied embedding with
Megatron DDP and the loss adding into main_grad, and PP=2 (MTP on the last stage, two
micro-batches). A 2-layer GPT of hidden 32 and a 128-token vocabulary, impl cce_kahan_full_c (the
one-pass Triton path, under the interpreter). ``pytest -s`` prints the measured errors.
"""

import dataclasses
import math
import time
import traceback

import pytest
import torch

from tests.dist import spawn

pytestmark = pytest.mark.distributed

TOL = 1e-6  # fp32, against megatron-core's own MTP (measured: 5e-7 at most)
SLOW_PATHS = {"lean", "recomputed", "mask_corrected", "deferred"}  # UpstreamState.paths of a recompute


def _cases():
    from tests.megatron.gpt_setup import Setup

    return [
        (Setup("tp2-mtp1", tp=2, ignore_frac=0.25), 1),
        (Setup("tp2-sp-mtp2", tp=2, sp=True, ignore_frac=0.25), 2),
        (Setup("tp2-sp-tied-ddp-mtp2", tp=2, sp=True, tied=True, ddp=True, ignore_frac=0.25), 2),
        (Setup("pp2-ddp-mtp1", pp=2, ddp=True, microbatches=2, ignore_frac=0.25), 1),
    ]


def _build(setup, depths: int, device, cce: bool):
    """The GPTModel of this rank's stage with `depths` MTP layers (on the last stage), DDP-wrapped
    where the setup says; with cce switched by use_cce (the layer adding into main_grad under DDP)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel

    from cce_parallel.megatron import local_gpt_block_spec, use_cce
    from cce_parallel.train.gpt import mtp_block_spec
    from tests.megatron.gpt_setup import Built, make_config

    config = dataclasses.replace(make_config(setup), mtp_num_layers=depths)
    torch.manual_seed(1)
    block = local_gpt_block_spec(config)
    gpt = GPTModel(
        config,
        block,
        vocab_size=setup.vocab,
        max_sequence_length=setup.seq,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=setup.tied,
        mtp_block_spec=mtp_block_spec(config, block, use_te=False),
    ).to(device)
    if cce:
        use_cce(gpt, impl="cce_kahan_full_c")
    model = gpt
    if setup.ddp:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
        if cce and gpt.post_process:
            gpt.output_layer.gradient_accumulation_fusion = True
    return Built(model=model, gpt=gpt, config=config)


def _step(setup, built, batches, *, loss_weights=None) -> dict:
    """One step as Megatron-LM's pretrain_gpt + megatron-core's schedule take it (the pipeline
    driven by hand on CPU): the model gets labels and loss_mask, loss_func sums loss × mask, the
    schedule divides by the token count and the micro-batches and sets MTPLossAutoScaler's scale
    to 1 / micro-batches. Returns {"loss": [masked [b, s] per micro-batch], "mtp": [each depth's
    logged loss, summed over the micro-batches], "grads": {name: grad}} (last stage: loss, mtp)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
    from megatron.core.utils import get_attr_wrapped_model

    model, gpt = built.model, built.gpt
    if setup.ddp:
        model.zero_grad_buffer()
    for p in gpt.parameters():
        p.grad = None
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(batches)))
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(pp_group)
    stage, last = parallel_state.get_pipeline_model_parallel_rank(), gpt.post_process
    shape = (setup.seq // (setup.tp if setup.sp else 1), setup.mbs, setup.hidden)
    losses = []
    for i, b in enumerate(batches):
        inp = None
        if stage > 0:
            inp = torch.empty(shape)
            dist.recv(inp, src=ranks[stage - 1], group=pp_group)
            get_attr_wrapped_model(model, "set_input_tensor")(inp.requires_grad_())
        extra = {"loss_weights": loss_weights} if loss_weights is not None else {}
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"], **extra)
        if not last:
            dist.send(out.detach().contiguous(), dst=ranks[stage + 1], group=pp_group)
            grad = torch.empty_like(out)
            dist.recv(grad, src=ranks[stage + 1], group=pp_group)
            out.backward(grad)
        else:
            mask = b["loss_mask"]
            losses.append((out.detach() * mask).tolist())
            ((out * mask).sum() / mask.sum() / len(batches)).backward()
        if stage > 0:
            dist.send(inp.grad.contiguous(), dst=ranks[stage - 1], group=pp_group)
    if setup.ddp:
        finalize_model_grads([model])
    tracker = MTPLossLoggingHelper.tracker
    logged = tracker.get("values", tracker.get("loss_values"))  # megatron-core 0.16 / 0.19
    grads = {}
    for name, p in gpt.named_parameters():
        g = p.main_grad if setup.ddp else p.grad
        grads[name] = None if g is None else g.detach().clone()
    return {"loss": losses, "mtp": [] if logged is None else logged.tolist(), "grads": grads,
            "counts": {k: tracker[k].tolist() for k in ("correct_values", "total_values") if k in tracker}}


def _errors(cce: dict, ref: dict) -> dict:
    from tests.megatron.gpt_setup import rel_err

    out = {"loss": 0.0, "mtp": 0.0, "grad": 0.0, "grad_name": None, "missing": []}
    assert len(cce["loss"]) == len(ref["loss"])
    for a, b in zip(cce["loss"], ref["loss"]):
        out["loss"] = max(out["loss"], rel_err(torch.tensor(a), torch.tensor(b)))
    assert len(cce["mtp"]) == len(ref["mtp"]), (cce["mtp"], ref["mtp"])
    if ref["mtp"]:
        out["mtp"] = rel_err(torch.tensor(cce["mtp"]), torch.tensor(ref["mtp"]))
    for name, b in ref["grads"].items():
        a = cce["grads"].get(name)
        if (a is None) != (b is None):
            out["missing"].append(name)
        elif a is not None:
            err = rel_err(a, b)
            if err >= out["grad"]:
                out["grad"], out["grad_name"] = err, name
    out["same_params"] = sorted(cce["grads"]) == sorted(ref["grads"])
    return out


def _run_case(setup, depths, device, report):
    from tests.megatron.gpt_setup import init_parallel, make_batches

    init_parallel(setup, device)
    batches = make_batches(setup, device)
    ref = _step(setup, _build(setup, depths, device, cce=False), batches)
    cce_built = _build(setup, depths, device, cce=True)
    cce = _step(setup, cce_built, batches)
    out = _errors(cce, ref)
    out["mtp_values"] = (cce["mtp"], ref["mtp"])
    out["acceptance_counts"] = cce["counts"]  # megatron-core 0.19: what the CCE depths added (0)
    gpt = cce_built.gpt
    if gpt.post_process:
        layer = gpt.output_layer
        out["main_paths"] = dict(layer.cce_state.paths)
        out["depth_paths"] = {k: dict(s.paths) for k, s in layer.mtp_cce_states.items()}
        out["repr_shows_depths"] = all(f"{k}: UpstreamState" in repr(layer) for k in range(1, depths + 1))
        layer.reset_cce_state()
        out["reset_forgets"] = not layer.cce_state.paths and not any(s.paths for s in layer.mtp_cce_states.values())
        if setup.pp == 1:
            _check_weights_and_routing(setup, cce_built, batches[0], out)
    report.result(setup.name, out)


def _check_weights_and_routing(setup, built, batch, out):
    """loss_weights and entropy_weights weight the main head's loss (the model's output) and not the
    MTP depths'; route_labels raises when the calls leave labels unused."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    gpt, layer = built.gpt, built.gpt.output_layer
    w = torch.linspace(0.5, 2.0, batch["labels"].numel()).reshape(batch["labels"].shape)
    with torch.no_grad():
        MTPLossLoggingHelper.tracker.clear()
        kwargs = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
        plain = built.model(batch["tokens"], batch["position_ids"], None, **kwargs)
        plain_mtp = MTPLossLoggingHelper.tracker.get("values", MTPLossLoggingHelper.tracker.get("loss_values")).clone()
        MTPLossLoggingHelper.tracker.clear()
        weighted = built.model(batch["tokens"], batch["position_ids"], None, loss_weights=w, **kwargs)
        weighted_mtp = MTPLossLoggingHelper.tracker.get("values", MTPLossLoggingHelper.tracker.get("loss_values"))
        weighted_mtp = weighted_mtp.clone()
        MTPLossLoggingHelper.tracker.clear()
        with_entropy = built.model(batch["tokens"], batch["position_ids"], None, entropy_weights=1.0, **kwargs)
        entropy_mtp = MTPLossLoggingHelper.tracker.get("values", MTPLossLoggingHelper.tracker.get("loss_values"))
    from tests.megatron.gpt_setup import rel_err

    out["weighted_main"] = rel_err(weighted, w * plain)
    out["weighted_mtp_unchanged"] = torch.equal(weighted_mtp, plain_mtp) and torch.equal(entropy_mtp, plain_mtp)
    # entropy_weights=1: the main head's loss plus each kept token's entropy, in (0, log V].
    entropy, kept = with_entropy - plain, batch["loss_mask"] > 0
    out["entropy_main"] = bool(
        (entropy[kept] > 0).all() and (entropy[kept] <= math.log(setup.vocab) + 1e-5).all()
        and (entropy[~kept] == 0).all()
    )
    # Depth labels routed, but only one call: the block must raise (the labels went unused).
    s_local = setup.seq // (setup.tp if setup.sp else 1)
    hidden = torch.randn(s_local, setup.mbs, setup.hidden)
    try:
        with torch.no_grad(), layer.route_labels(batch["labels"], mtp_labels=[batch["labels"]]):
            layer(hidden, weight=gpt.shared_embedding_or_output_weight() if setup.tied else None)
        out["unused_labels_raise"] = "no error"
    except RuntimeError as err:
        out["unused_labels_raise"] = "went unused" in str(err) and "the main head" in str(err)
    out["routes_cleared"] = layer._cce_pending_labels is None and not layer._cce_pending_mtp


def _worker(rank, world, report):
    import warnings

    warnings.filterwarnings("ignore")
    from tests.megatron.gpt_setup import install_cpu_shims

    install_cpu_shims()  # also makes megatron-core's MTP loss tracker allocate on the CPU
    device = torch.device("cpu")
    for setup, depths in _cases():
        report.started(setup.name)
        t0 = time.monotonic()
        try:
            _run_case(setup, depths, device, report)
        except Exception:  # noqa: BLE001 - reported, the parent fails the test with it
            report.result(f"{setup.name}/FAILED", traceback.format_exc())
        report.result(f"{setup.name}/seconds", time.monotonic() - t0)


@pytest.fixture(scope="module")
def outcome():
    return spawn(_worker, 2, timeout=300.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["tp2-mtp1", "tp2-sp-mtp2", "tp2-sp-tied-ddp-mtp2", "pp2-ddp-mtp1"])
def test_mtp_matches_megatron(outcome, name):
    assert outcome.ok, outcome.describe()
    merged = outcome.merged()
    assert name in merged, merged.get(f"{name}/FAILED", "the case did not run")
    depths = {"tp2-mtp1": 1, "pp2-ddp-mtp1": 1}.get(name, 2)
    for rank, r in merged[name].items():
        print(f"  {name} rank {rank} ({merged[name + '/seconds'][rank]:.1f} s): {r}")
        assert r["same_params"] and not r["missing"], r
        assert r["grad"] <= TOL, f"rank {rank}: {r['grad_name']} gradient off by {r['grad']:.2e}: {r}"
        assert r["loss"] <= TOL and r["mtp"] <= TOL, r
        assert not any(sum(v) for v in r["acceptance_counts"].values()), r
        if "main_paths" not in r:  # not the last pipeline stage
            continue
        mtp, ref_mtp = r["mtp_values"]
        assert len(mtp) == depths and all(v > 0 for v in mtp), r
        # Every call took the one-pass path and every backward only scaled its gradients (the
        # depths' upstream gradients are one number over their kept tokens: the masks are folded).
        micro = 2 if name.startswith("pp2") else 1
        assert sorted(r["depth_paths"]) == list(range(1, depths + 1)), r
        for k, paths in [("main", r["main_paths"]), *r["depth_paths"].items()]:
            assert paths.get("one_pass") == micro and not SLOW_PATHS & set(paths), f"rank {rank} {k}: {paths}"
        assert r["repr_shows_depths"] and r["reset_forgets"], r
        if "weighted_main" in r:
            assert r["weighted_main"] <= 1e-6 and r["weighted_mtp_unchanged"] and r["entropy_main"], r
            assert r["unused_labels_raise"] is True and r["routes_cleared"], r
