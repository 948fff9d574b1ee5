"""The train job's loss_func and batches: the folded loss mask (no per-token gradient, no per-token check)."""

import pytest
import torch

pytest.importorskip("megatron.core")

import cce_parallel  # noqa: E402
from cce_parallel.megatron import mask_labels  # noqa: E402
from cce_parallel.ops import upstream as ops_upstream  # noqa: E402
from cce_parallel.train.data import Batches  # noqa: E402
from cce_parallel.train.trainer import loss_func  # noqa: E402


@pytest.mark.parametrize("budget", ["auto", "lean"])
def test_folded_mask_sums_the_same_and_needs_no_per_token_check(budget, monkeypatch):
    """With the mask folded into the labels, loss_func's plain sum equals the masked sum bit for bit,
    and the backward gets one number for every token: the per-token check (on the device)
    never runs. The gradients equal those of Megatron's masked sum (which does run it)."""
    g = torch.Generator().manual_seed(0)
    b, s, d, v = 3, 7, 16, 45
    e0 = torch.randn(b * s, d, generator=g)
    c0 = torch.randn(v, d, generator=g) * 0.3
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    folded = mask_labels(labels, mask)
    grads, totals = [], []
    real = ops_upstream._weights_over_kept
    for is_folded in (False, True):
        calls = []
        monkeypatch.setattr(ops_upstream, "_weights_over_kept", lambda *a: calls.append(1) or real(*a))
        e, c = e0.clone().requires_grad_(), c0.clone().requires_grad_()
        per_token = cce_parallel.linear_cross_entropy(e, c, folded.reshape(-1), reduction="none",
                                                      logits_budget=budget).view(b, s)
        total, count, _ = loss_func(mask, per_token, folded=is_folded)
        (total / count).backward()
        grads.append((e.grad, c.grad))
        totals.append(total.detach())
        assert bool(calls) == (not is_folded and budget == "auto")
    assert torch.equal(totals[0], totals[1])
    for a, r in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


class _Items:
    def __init__(self, mask):
        self.mask = mask

    def __len__(self):
        return 4

    def __getitem__(self, i):
        s = self.mask.shape[0]
        return {"tokens": torch.arange(s), "labels": torch.arange(s), "loss_mask": self.mask,
                "position_ids": torch.arange(s)}


def test_batches_reject_a_loss_mask_that_is_not_0_or_1():
    kwargs = dict(micro_batch_size=2, global_batch_size=4, dp_rank=0, dp_size=1, device="cpu")
    ok = next(Batches(_Items(torch.tensor([1.0, 0.0, 1.0])), **kwargs).microbatches(0))
    assert ok["loss_mask"].tolist() == [[1.0, 0.0, 1.0]] * 2
    with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1, got \\[0.5, 1.0\\]"):
        next(Batches(_Items(torch.tensor([1.0, 0.5, 1.0])), **kwargs).microbatches(0))
