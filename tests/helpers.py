"""Test inputs, a runner that returns loss + gradients, and comparison helpers.

Nothing here imports cce_parallel: the function under test is passed in.
"""

import math
import os
from collections.abc import Callable

import torch

from tests.oracle import Outputs, oracle, rel_err


def child_pythonpath(*first) -> str:
    """PYTHONPATH for a child process: `first`, then the caller's PYTHONPATH (where packages may be
    installed with pip --target, as megatron-core is on the GPU image)."""
    outer = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(p) for p in first] + ([outer] if outer else []))

FIELDS = ("loss", "lse", "de", "dc", "dbias")


def gpu_run() -> bool:
    """True on the GPU machine: CCE_TEST_GPU=1 and CUDA present (then kernels are compiled)."""
    return os.environ.get("CCE_TEST_GPU") == "1" and torch.cuda.is_available()


def generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _apply_ignore(targets, frac, ignore_index, g):
    if frac >= 1.0:
        return torch.full_like(targets, ignore_index)
    if frac <= 0.0:
        return targets
    drop = torch.rand(targets.shape, generator=g, device=targets.device) < frac
    return torch.where(drop, torch.full_like(targets, ignore_index), targets)


def random_inputs(
    lead,
    vocab,
    dim,
    *,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    logit_std=2.0,
    bias=False,
    ignore_frac=0.0,
    ignore_index=-100,
) -> dict:
    """Gaussian e, c with logits ~ N(0, logit_std**2); uniform targets; a fraction ignored."""
    g = generator(device, seed)
    n = math.prod(lead)
    c = torch.randn(vocab, dim, generator=g, device=device) / math.sqrt(dim)
    e = torch.randn(n, dim, generator=g, device=device) * logit_std
    b = torch.randn(vocab, generator=g, device=device) * 0.5 if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g, device=device)
    targets = _apply_ignore(targets, ignore_frac, ignore_index, g)
    return {
        "e": e.reshape(*lead, dim).to(dtype),
        "c": c.to(dtype),
        "targets": targets.reshape(lead),
        "bias": None if b is None else b.to(dtype),
    }


def peaked_inputs(
    lead,
    vocab,
    dim,
    *,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    n_head=16,
    n_mid=128,
    level=(12.0, 14.0),
    boost=4.0,
    noise=1.0,
    n_rare=3,
) -> dict:
    """Trained-model-like inputs: most probability mass on a few frequent ids, often the target.

    Coordinate 0 of c classes the vocabulary: +1 for the head [0, n_head), 0 for the next n_mid
    ids, -1 for the tail; coordinate 0 of e is a per-token level in `level`. So the head logits sit
    near +level, the middle near 0 (probabilities ~exp(-level - log n_head), between 2**-28 and
    2**-12) and the tail near -level (below 2**-28): whole vocabulary blocks are skippable.
    Targets are Zipf-distributed over the head and get `boost` extra logit; `n_rare` tokens,
    spread over the sequence, have their target in the tail (the last id included), so a block
    holding a target must never be skipped. The rest of c is Gaussian with unit-norm rows and the
    rest of e Gaussian, adding N(0, noise**2) to every logit.
    """
    g = generator(device, seed)
    n = math.prod(lead)
    klass = torch.full((vocab,), -1.0, device=device)
    klass[:n_head] = 1.0
    klass[n_head : n_head + n_mid] = 0.0
    r = torch.randn(vocab, dim - 1, generator=g, device=device) / math.sqrt(dim - 1)
    c = torch.cat([klass[:, None], r], dim=1)

    zipf = torch.arange(1, n_head + 1, device=device, dtype=torch.float64) ** -1.1
    targets = torch.multinomial(zipf, n, replacement=True, generator=g)
    if n_rare:
        rare_pos = torch.linspace(0, n - 1, n_rare, device=device).round().long()
        tail = n_head + n_mid
        rare_ids = torch.randint(tail, vocab, (n_rare,), generator=g, device=device)
        rare_ids[-1] = vocab - 1
        targets[rare_pos] = rare_ids

    lo, hi = level
    e_level = lo + (hi - lo) * torch.rand(n, generator=g, device=device)
    e_rest = torch.randn(n, dim - 1, generator=g, device=device) * noise
    r_t = r[targets]
    e_rest += boost * r_t / (r_t * r_t).sum(-1, keepdim=True)
    e = torch.cat([e_level[:, None], e_rest], dim=1)
    return {
        "e": e.reshape(*lead, dim).to(dtype),
        "c": c.to(dtype),
        "targets": targets.reshape(lead),
        "bias": None,
    }


def upstream(targets, reduction, return_lse, *, seed=1, uniform=False, ignore_index=-100, masked=0.0):
    """Random upstream gradients: for the loss (scalar or shaped like targets) and for lse or None.

    uniform: with reduction "none", one random number on every kept token and 0 on ignored ones,
    as Megatron's loss_mask / count gives (the one-pass path's scalable case). masked: with
    uniform, about that fraction of the tokens get 0 too, as Megatron's loss_mask / count gives
    where the mask is not folded into ignore_index."""
    g = generator(targets.device, seed)
    dev = targets.device
    shape = targets.shape if reduction == "none" else ()
    grad_loss = torch.randn(shape, generator=g, device=dev)
    if uniform and reduction == "none":
        keep = targets != ignore_index
        if masked:
            keep &= torch.rand(targets.shape, generator=g, device=dev) >= masked
        grad_loss = torch.where(keep, grad_loss.reshape(-1)[0], 0.0)
    grad_lse = torch.randn(targets.shape, generator=g, device=dev) if return_lse else None
    return grad_loss, grad_lse


def run(fn: Callable, inputs: dict, options: dict, grad_loss=None, grad_lse=None) -> Outputs:
    """Call fn(e, c, targets, bias=..., **options) and backpropagate the upstream gradients.

    grad_loss defaults to 1 (scalar reductions) or ones. The lse gradient is used only when
    options ask for return_lse and grad_lse is given. Unused inputs get zero gradients.
    """
    # detach() keeps the inputs' strides (clone() would make padded views contiguous).
    leaves = [inputs["e"].detach().requires_grad_(), inputs["c"].detach().requires_grad_()]
    if inputs.get("bias") is not None:
        leaves.append(inputs["bias"].detach().requires_grad_())
    bias = leaves[2] if len(leaves) == 3 else None
    out = fn(leaves[0], leaves[1], inputs["targets"], bias=bias, **options)
    loss, lse = out if options.get("return_lse") else (out, None)
    assert loss.requires_grad, "the loss must be differentiable when the inputs require grad"
    outs = [loss]
    grads_in = [torch.ones_like(loss) if grad_loss is None else grad_loss.to(loss.dtype)]
    if lse is not None and grad_lse is not None:
        outs.append(lse)
        grads_in.append(grad_lse.to(lse.dtype))
    grads = torch.autograd.grad(outs, leaves, grads_in, allow_unused=True)
    grads = [torch.zeros_like(x) if gx is None else gx for x, gx in zip(leaves, grads)]
    return Outputs(
        loss=loss.detach(),
        lse=None if lse is None else lse.detach(),
        de=grads[0],
        dc=grads[1],
        dbias=grads[2] if bias is not None else None,
    )


def check_meta(out: Outputs, inputs: dict, options: dict):
    """Output dtypes and shapes from the contract: fp32 loss/lse, gradients in the input dtype."""
    targets = inputs["targets"]
    loss_shape = targets.shape if options.get("reduction", "mean") == "none" else torch.Size([])
    assert out.loss.dtype == torch.float32, f"loss dtype {out.loss.dtype}, expected float32"
    assert out.loss.shape == loss_shape, f"loss shape {tuple(out.loss.shape)}, expected {tuple(loss_shape)}"
    if options.get("return_lse"):
        assert out.lse is not None
        assert out.lse.dtype == torch.float32, f"lse dtype {out.lse.dtype}, expected float32"
        assert out.lse.shape == targets.shape, f"lse shape {tuple(out.lse.shape)}"
    for name, key in (("de", "e"), ("dc", "c"), ("dbias", "bias")):
        grad, x = getattr(out, name), inputs.get(key)
        if x is None:
            continue
        assert grad.dtype == x.dtype, f"{name} dtype {grad.dtype}, expected {x.dtype}"
        assert grad.shape == x.shape, f"{name} shape {tuple(grad.shape)}, expected {tuple(x.shape)}"


def errors(out: Outputs, ref: Outputs) -> dict:
    """Relative Frobenius error of every output present in both."""
    return {
        name: rel_err(getattr(out, name), getattr(ref, name))
        for name in FIELDS
        if getattr(out, name) is not None and getattr(ref, name) is not None
    }


def assert_errors_below(errs: dict, tol, label: str = ""):
    """tol: one float for all outputs, or a dict per output name."""
    bad = {k: v for k, v in errs.items() if not v <= (tol[k] if isinstance(tol, dict) else tol)}
    shown = ", ".join(f"{k}={v:.2e}" for k, v in errs.items())
    assert not bad, f"{label}: relative errors too large: {shown} (tolerance {tol})"


def check_against_oracle(
    fn, inputs, options, tol, *, grad_loss=None, grad_lse=None, label="", chunk_size: int | None = None
) -> dict:
    """Run fn, check output metadata, compare every output with the float64 oracle; return errors."""
    out = run(fn, inputs, options, grad_loss, grad_lse)
    check_meta(out, inputs, options)
    ref = oracle(**inputs, grad_loss=grad_loss, grad_lse=grad_lse, chunk_size=chunk_size, **options)
    errs = errors(out, ref)
    assert_errors_below(errs, tol, label)
    return errs
