"""The targets' one pass before the loss: each token's row in this rank's shard, whether it counts,
and the counts the host checks later, in one launch and with no host sync (ops/functional.py).

A single program walks all tokens (a few microseconds for tens of thousands); one launch costs the
host far less than the dozen small PyTorch ops it replaces, and the host launches it ahead of the
loss's GEMMs, which cannot start before it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _targets_kernel(T_ptr, Local_ptr, Keep_ptr, Count_ptr, Scale_ptr, n, ignore, vocab, start, shard,
                    PER_KEPT: tl.constexpr, BLOCK: tl.constexpr):
    kept = tl.zeros([BLOCK], tl.int64)
    bad = tl.zeros([BLOCK], tl.int64)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        inside = offs < n
        t = tl.load(T_ptr + offs, mask=inside, other=0).to(tl.int64)
        keep = inside & (t != ignore)
        kept += keep.to(tl.int64)
        bad += (keep & ((t < 0) | (t >= vocab))).to(tl.int64)
        here = keep & (t >= start) & (t < start + shard)
        tl.store(Local_ptr + offs, tl.where(here, t - start, -1), mask=inside)
        tl.store(Keep_ptr + offs, keep, mask=inside)
    n_keep = tl.sum(kept, axis=0)
    tl.store(Count_ptr, n_keep)
    tl.store(Count_ptr + 1, tl.sum(bad, axis=0))
    if PER_KEPT:  # 1 / kept tokens, rounded as torch's fp32 division rounds it (1 when none is kept)
        scale = tl.math.div_rn(1.0, tl.maximum(n_keep, 1).to(tl.float32))
    else:
        scale = 1.0
    tl.store(Scale_ptr, scale)


def prepare_targets(targets: torch.Tensor, ignore_index: int, vocab: int, start: int, shard: int, per_kept: bool):
    """(local [n] int64, keep [n] bool, counts [2] int64, scale [] fp32) of targets [n] (any integer
    dtype): local = target - start where the target is kept and in [start, start + shard), else -1;
    counts = (kept, kept but outside [0, vocab)); scale = 1 / kept if `per_kept` (1 if none), else 1."""
    n = targets.shape[0]
    dev = targets.device
    local = torch.empty(n, device=dev, dtype=torch.int64)
    keep = torch.empty(n, device=dev, dtype=torch.bool)
    counts = torch.empty(2, device=dev, dtype=torch.int64)
    scale = torch.empty((), device=dev, dtype=torch.float32)
    block = 4096
    _targets_kernel[(1,)](
        targets, local, keep, counts, scale, n, ignore_index, vocab, start, shard, PER_KEPT=per_kept, BLOCK=block,
        num_warps=8 if targets.is_cuda else 1,
    )
    return local, keep, counts, scale
