"""temperature=: the logits divided by T before the softcap, on every path, against the float64
oracle (tests/oracle.py: z = softcap * tanh(x / T / softcap)). fp32 on CPU under the interpreter,
or CUDA with CCE_TEST_GPU=1. Tensor parallelism: tests/parallel/test_vocab_parallel.py's
bias-softcap-none and everything cases carry a temperature."""

import pytest
import torch

from cce_parallel import LinearCrossEntropy, linear_cross_entropy
from tests.helpers import check_against_oracle, random_inputs, run, upstream

V, D, N = 517, 48, 37
TOL = {"loss": 1e-5, "lse": 1e-5, "de": 5e-5, "dc": 5e-5, "dbias": 5e-5}

# Each reaches another path: the fused one-pass GEMM with a softcap (its target entry's slope),
# the two-pass variant (softcap with label smoothing), the lean path with a gradient through lse,
# and per-token upstream gradients (kernels.weighted_grads recomputes dC).
PATHS = {
    "fused-softcap": ({"softcap": 20.0, "temperature": 0.7, "reduction": "mean"}, 20.0, False),
    "two-pass": ({"softcap": 20.0, "label_smoothing": 0.1, "z_loss": 1e-3, "temperature": 1.6,
                  "reduction": "sum"}, 20.0, False),
    "lean-lse": ({"logits_budget": "lean", "return_lse": True, "temperature": 0.5, "reduction": "none",
                  "ignore_index": 3}, 2.0, False),
    "per-token": ({"temperature": 0.8, "reduction": "none"}, 2.0, True),
}


@pytest.mark.parametrize("impl", ["torch", "cce_kahan_full_c"])
@pytest.mark.parametrize("path", list(PATHS))
def test_temperature_matches_the_oracle(path, impl, device):
    options, logit_std, per_token = PATHS[path]
    x = random_inputs((N,), V, D, device=device, bias=True, logit_std=logit_std, ignore_frac=0.2,
                      ignore_index=options.get("ignore_index", -100))
    grad_loss, grad_lse = upstream(x["targets"], options["reduction"], options.get("return_lse"),
                                   uniform=not per_token, ignore_index=options.get("ignore_index", -100))
    check_against_oracle(linear_cross_entropy, x, dict(options, impl=impl), TOL, grad_loss=grad_loss,
                         grad_lse=grad_lse, label=f"temperature {path} {impl}")


def test_temperature_one_is_the_default_bit_for_bit(device):
    x = random_inputs((N,), V, D, device=device, bias=True, ignore_frac=0.2)
    plain = run(linear_cross_entropy, x, {"impl": "cce_kahan_full_c"})
    one = run(linear_cross_entropy, x, {"impl": "cce_kahan_full_c", "temperature": 1.0})
    assert all(torch.equal(a, b) for a, b in zip(plain, one) if a is not None)


def test_the_module_takes_a_temperature(device):
    x = random_inputs((N,), V, D, device=device)
    loss = LinearCrossEntropy(impl="torch", temperature=2.0)(x["e"], x["c"], x["targets"])
    want = torch.nn.functional.cross_entropy((x["e"] @ x["c"].T).double() / 2.0, x["targets"])
    assert abs(loss.item() - want.item()) < 1e-5


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "2", True, None])
def test_a_bad_temperature_is_refused_by_name(bad):
    x = random_inputs((4,), 11, 8, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="^temperature must be a finite positive number"):
        linear_cross_entropy(x["e"], x["c"], x["targets"], temperature=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"temperature": 0.7}, {"temperature": 1.3, "softcap": 30.0},
                                     {"temperature": 0.6, "reduction": "none"}], ids=["plain", "softcap", "per-token"])
def test_bf16_with_a_temperature_is_no_worse_than_plain_pytorch(options, cuda):
    """bf16 at N=2048, V=32003, D=1024, trained-model-like logits: loss and gradients against the
    fp64 oracle within plain bf16 PyTorch's error (5 % slack), the fused one-pass GEMM and, for a
    per-token upstream, its recompute."""
    from tests.helpers import errors, peaked_inputs
    from tests.ops.test_gpu import worse_than_plain
    from tests.oracle import oracle, plain_torch

    x = peaked_inputs((2048,), 32003, 1024, dtype=torch.bfloat16, device=cuda, n_head=256, n_mid=4096, boost=7.0,
                      n_rare=32)
    reduction = options.get("reduction", "mean")
    grad_loss, _ = upstream(x["targets"], reduction, False)
    options = dict(options, reduction=reduction)
    ref = oracle(**x, grad_loss=grad_loss, chunk_size=2048, **options)
    plain = errors(plain_torch(**x, grad_loss=grad_loss, **options), ref)
    ours = errors(run(linear_cross_entropy, x, dict(options, impl="cce_kahan_full_c"), grad_loss), ref)
    bad = worse_than_plain(ours, plain)
    assert not bad, f"worse than plain bf16 PyTorch: {bad}; ours {ours}, plain {plain}"
