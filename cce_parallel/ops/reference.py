"""Pure-PyTorch CCE: the CPU path, the fallback, and the oracle the kernels are checked against.

It computes the same per-token statistics and gradients as the Triton kernels (kernels/), chunked
over tokens so that memory stays O(chunk * V): the full N x V logit matrix never exists.
Logits are computed by the input dtype's matmul (as plain PyTorch would) and handled in fp32;
gradients accumulate in fp32.
"""

import torch

# Elements of fp32 logits per chunk: 2**26 is 256 MB.
_CHUNK_ELEMENTS = 1 << 26


def _chunks(n: int, v: int):
    step = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for start in range(0, n, step):
        yield start, min(n, start + step)


def _logits(e, c, bias, softcap, temperature=1.0):
    """fp32 logits z of a token chunk (x = e c^T + bias, divided by the temperature, then the
    softcap), and tanh(x / temperature / softcap) (None without softcap)."""
    x = (e @ c.t()).float()
    if bias is not None:
        x = x + bias.float()
    if temperature != 1.0:
        x = x * (1.0 / temperature)
    if softcap is None:
        return x, None
    t = torch.tanh(x / softcap)
    return softcap * t, t


def _target_mask(tgt, v):
    """One-hot [n, v] of the targets that fall in [0, v) (others are owned elsewhere or ignored)."""
    inside = (tgt >= 0) & (tgt < v)
    onehot = torch.zeros((tgt.shape[0], v), dtype=torch.bool, device=tgt.device)
    rows = torch.nonzero(inside).squeeze(1)
    onehot[rows, tgt[rows]] = True
    return onehot


def forward_stats(e, c, bias, targets, softcap, *, need_zsum: bool, temperature=1.0, need_pz: bool = False):
    """Per-token (max, sumexp, zt, zsum, pz) over the rows of c, pz = sum exp(z - max) z (None
    unless need_pz, zsum likewise); the fp64 twin of ops.lean.local_stats."""
    n, v = e.shape[0], c.shape[0]
    f32 = dict(device=e.device, dtype=torch.float32)
    mx, se, zt = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    zsum = torch.empty(n, **f32) if need_zsum else None
    pz = torch.empty(n, **f32) if need_pz else None
    for lo, hi in _chunks(n, v):
        z, _ = _logits(e[lo:hi], c, bias, softcap, temperature)
        m = z.max(dim=1).values
        mx[lo:hi] = m
        q = torch.exp(z - m[:, None])
        se[lo:hi] = q.sum(dim=1)
        if pz is not None:
            pz[lo:hi] = torch.where(q > 0, q * z, 0.0).sum(dim=1)
        zt[lo:hi] = torch.where(_target_mask(targets[lo:hi], v), z, 0.0).sum(dim=1)
        if zsum is not None:
            zsum[lo:hi] = z.sum(dim=1)
    return mx, se, zt, zsum, pz


def backward(e, c, bias, targets, lse, coef_a, coef_b, coef_u, softcap, dc_out=None, temperature=1.0, coef_h=None):
    """(dE in fp32, dC and dbias in the input dtype); dz = A p - B onehot - U, through the softcap
    (the coefficients carry the temperature's 1 / T, ops/common.coefficients).

    dE stays fp32 so that tensor-parallel ranks can sum their partial dE before rounding. dc_out:
    an fp32 [V, D] tensor that dC is added to (unrounded) and returned as dC, or None.
    """
    n, v = e.shape[0], c.shape[0]
    de = torch.empty(e.shape, device=e.device, dtype=torch.float32)
    dc = torch.zeros(c.shape, device=c.device, dtype=torch.float32)
    db = torch.zeros(v, device=c.device, dtype=torch.float32) if bias is not None else None
    for lo, hi in _chunks(n, v):
        z, t = _logits(e[lo:hi], c, bias, softcap, temperature)
        p = torch.exp(z - lse[lo:hi, None])
        dz = coef_a[lo:hi, None] * p
        dz -= torch.where(_target_mask(targets[lo:hi], v), coef_b[lo:hi, None], 0.0)
        if coef_u is not None:
            dz -= coef_u[lo:hi, None]
        if coef_h is not None:  # an entropy term: -h p z (its h E[z] is inside A)
            dz -= coef_h[lo:hi, None] * p * z
        if t is not None:
            dz *= 1.0 - t * t
        if db is not None:
            db += dz.sum(dim=0)
        dz_lp = dz.to(e.dtype)
        de[lo:hi] = (dz_lp @ c).float()
        dc += (dz_lp.t() @ e[lo:hi]).float()
    dc = dc_out.add_(dc) if dc_out is not None else dc.to(c.dtype)
    return de, dc, db.to(bias.dtype) if db is not None else None
