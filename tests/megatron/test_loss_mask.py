"""GPTModel.forward(..., labels=labels, loss_mask=loss_mask) with CCE: the layer folds the mask.

Megatron-LM's pretrain_gpt passes the batch's loss_mask to the model and its loss_func then takes
``(loss * loss_mask).sum() / count``. A model switched by ``use_cce`` folds that mask into the
labels (``mask_labels``): masked tokens' losses are exactly 0 and the kept ones are the unmasked
call's, the gradients are those of Megatron's own path (and bit for bit those of labels folded by
hand), and the upstream gradient is one number over the kept tokens, so the one-pass loss only
scales the gradients it computed in the forward (the lean backward does not run). Without the fold
the masked tokens keep their losses, and the upstream gradient, one number and 0 on the masked
tokens, makes the first backward recompute (on the device) and later ones subtract the masked
rows' part (one more one-pass sweep of those rows alone). What the output layer learns is its own
(``output_layer.cce_state``): another CCE model knows nothing of it, and ``reset_cce_state``
forgets it.

One gloo group of 2 processes, TP=2 (the vocabulary split), a 2-layer GPT of hidden 32 and a
128-token vocabulary, impl cce_kahan_full_c (the one-pass Triton path, under the interpreter).
"""

import time
import traceback

import pytest
import torch

from tests.dist import spawn

pytestmark = pytest.mark.distributed

TOL = 1e-5  # against Megatron's own loss: blockwise fp32 sums in another order (measured 4e-7)


def _grads(gpt) -> dict:
    return {n: p.grad.detach().clone() for n, p in gpt.named_parameters() if p.grad is not None}


def _step(built, batch, labels, loss_mask=None):
    """Forward (passing loss_mask to the model where given), Megatron's masked mean, backward:
    (per-token loss [b, s], grads by parameter name)."""
    for p in built.gpt.parameters():
        p.grad = None
    extra = {} if loss_mask is None else {"loss_mask": loss_mask}
    loss = built.model(batch["tokens"], batch["position_ids"], None, labels=labels, **extra)
    mask = batch["loss_mask"]
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach(), _grads(built.gpt)


def _check(device, report):
    from cce_parallel.megatron import cce_output_processor
    from cce_parallel.ops import autograd
    from tests.megatron.gpt_setup import Setup, build, init_parallel, make_batches, rel_err

    s = Setup("loss-mask", tp=2, ignore_frac=0.25)
    init_parallel(s, device)
    batch = make_batches(s, device)[0]
    mask = batch["loss_mask"]
    masked, kept = mask == 0, mask != 0
    out = {"masked_tokens": int(masked.sum())}

    ref = build(s, device)
    _, ref_grads = _step(ref, batch, batch["labels"])
    cce = build(s, device, cce={"impl": "cce_kahan_full_c"})
    lean_rows = []  # the tokens of each lean backward (a recompute)
    lean_backward = autograd.lean_backward
    autograd.lean_backward = lambda e, *a, **k: lean_rows.append(e.shape[0]) or lean_backward(e, *a, **k)
    pass_rows = []  # the tokens of each one-pass sweep (a forward's, or the masked rows' correction)
    one_pass = autograd.one_pass
    autograd.one_pass = lambda e, *a, **k: pass_rows.append(e.shape[0]) or one_pass(e, *a, **k)

    # The model gets the mask: masked tokens' losses are 0, the upstream gradient one number.
    state = cce.gpt.output_layer.cce_state
    loss, grads = _step(cce, batch, batch["labels"], loss_mask=mask)
    out["fast_path"] = not lean_rows and pass_rows == [batch["labels"].numel()]
    out["fast_paths"] = dict(state.paths)  # one one-pass forward, its gradients scaled, no recompute
    out["masked_loss_max"] = loss[masked].abs().max().item()
    out["grad_vs_megatron"] = max(rel_err(grads[n], g) for n, g in ref_grads.items())
    out["same_params"] = sorted(grads) == sorted(ref_grads)

    # Labels folded by hand (what the train job does): the same losses and gradients, bit for bit.
    folded_loss, folded_grads = _step(cce, batch, batch["cce_labels"])
    out["equals_hand_folded"] = torch.equal(loss, folded_loss) and all(
        torch.equal(grads[n], g) for n, g in folded_grads.items()
    )

    # The kept tokens' losses are those of the call without a mask.
    with torch.no_grad():
        hidden = {}
        handle = cce.gpt.output_layer.register_forward_pre_hook(lambda m, a: hidden.setdefault("h", a[0]))
        plain = cce.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        handle.remove()
        masked_again = cce.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=mask)
        processed = cce_output_processor(cce.model, hidden["h"], batch["labels"], loss_mask=mask)
    out["kept_equal_unmasked"] = torch.equal(masked_again[kept], plain[kept])
    # (Without a gradient the loss takes the lean path: the same values to fp32 rounding.)
    out["no_grad_vs_grad_call"] = rel_err(masked_again, loss)
    out["unmasked_has_loss_at_masked"] = bool((plain[masked] > 0).all())
    out["processor_equal"] = torch.equal(processed, masked_again)

    # The control: Megatron's masked mean without the fold has one upstream number and 0 on the
    # masked tokens (and the fast_path check above can fail): the first backward recomputes on the
    # device and reports the mask, the second corrects dC on the masked kept rows alone; every kept
    # token is masked or not, none is weighted otherwise.
    out["learned_before_control"] = state.masked_weights_seen or state.per_token_weights_seen
    _step(cce, batch, batch["labels"])
    state.read_reports()
    out["control_masked_seen"] = state.masked_weights_seen
    other = build(s, device, cce={"impl": "cce_kahan_full_c"}).gpt.output_layer.cce_state
    out["other_model_learned"] = other.masked_weights_seen or other.per_token_weights_seen
    del lean_rows[:], pass_rows[:]
    state.paths.clear()
    _, control_grads = _step(cce, batch, batch["labels"])
    out["control_lean_rows"] = lean_rows[:]
    out["control_pass_rows"] = pass_rows[:]
    out["tokens"] = batch["labels"].numel()
    out["control_paths"] = dict(state.paths)
    out["masked_kept"] = int((masked & (batch["labels"] >= 0)).sum())
    out["control_vs_megatron"] = max(rel_err(control_grads[n], g) for n, g in ref_grads.items())
    out["control_no_switch"] = not state.per_token_weights_seen
    cce.gpt.output_layer.reset_cce_state()
    out["reset_forgets"] = not state.masked_weights_seen and not state.paths
    autograd.lean_backward, autograd.one_pass = lean_backward, one_pass
    report.result("loss_mask", out)


def _worker(rank, world, report):
    import warnings

    warnings.filterwarnings("ignore")
    from tests.megatron.gpt_setup import install_cpu_shims

    install_cpu_shims()
    report.started("loss_mask")
    t0 = time.monotonic()
    try:
        _check(torch.device("cpu"), report)
    except Exception:  # noqa: BLE001 - reported, the parent fails the test with it
        report.result("loss_mask/FAILED", traceback.format_exc())
    report.result("loss_mask/seconds", time.monotonic() - t0)


@pytest.fixture(scope="module")
def outcome():
    return spawn(_worker, 2, timeout=300.0)


@pytest.mark.interpreter
def test_model_folds_the_loss_mask(outcome):
    assert outcome.ok, outcome.describe()
    merged = outcome.merged()
    assert "loss_mask" in merged, merged.get("loss_mask/FAILED", "the check did not run")
    for rank, r in merged["loss_mask"].items():
        print(f"  rank {rank}: {r}")
        assert r["masked_tokens"] > 0, "the batch masks no token: nothing tested"
        assert r["unmasked_has_loss_at_masked"], r
        assert r["masked_loss_max"] == 0.0, f"rank {rank}: masked tokens kept a loss: {r}"
        assert r["kept_equal_unmasked"] and r["processor_equal"] and r["no_grad_vs_grad_call"] <= 1e-6, r
        assert r["same_params"] and r["grad_vs_megatron"] <= TOL, r
        assert r["equals_hand_folded"], r
        assert r["fast_path"], f"rank {rank}: the backward recomputed per token (the mask was not folded): {r}"
        assert r["fast_paths"] == {"one_pass": 1, "checked": 1}, r
        assert not r["learned_before_control"], r
        assert r["control_masked_seen"] and r["control_lean_rows"] == [], r
        assert r["control_pass_rows"] == [r["tokens"], r["masked_kept"]], r
        assert r["control_paths"] == {"one_pass": 1, "mask_corrected": 1}, r
        assert not r["other_model_learned"] and r["reset_forgets"], r
        assert r["control_no_switch"], r
        assert r["control_vs_megatron"] <= TOL, r
