"""What the loss's paths share: the per-token math, the configuration, the collectives, and the
pieces both paths build on.

Per token, with z the (soft-capped) logits over the vocabulary and lse their log-sum-exp:

    loss = lse - (1 - ls) * z[target] - (ls / V) * sum_v z_v + z_loss * lse**2

so that, for upstream gradients g (of loss) and h (of lse),

    d/dz_v = A p_v - B [v == target] - U,   A = g (1 + 2 z_loss lse) + h,  B = g (1 - ls),  U = g ls / V.

The entropy, H = lse - E[z] with E[z] = sum_v p_v z_v, adds for its upstream gradient k the term
-k p_v (z_v - E[z]): k E[z] goes into A, and -k p_v z_v is one more per-entry term
(entropy_coefficients; kernels/tiles.logit_grad).

Under tensor parallelism each rank holds a shard of the vocabulary. Per token (block), the ranks
combine their max with one all-reduce (MAX) and their rescaled sums, target logits and logit sums
with one more (SUM) (_combine); dE is a partial sum, reduced in fp32; dC / dbias stay local. Each
rank's count of targets outside the vocabulary goes to every rank with the first SUM (on the lean
path in a small all-reduce of its own: _BadTargets), so that they all raise. No module of ops/
imports torch.distributed: parallel/ passes in the collectives (Collectives).
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class ImplTraits:
    """triton: False for the PyTorch path. Every Triton impl computes the same thing now that
    nothing is filtered and everything sums in fp32; the names stay for the API's users."""

    triton: bool = True


IMPL_TRAITS = {
    "cce": ImplTraits(),
    "cce_kahan": ImplTraits(),
    "cce_kahan_full_c": ImplTraits(),
    "cce_kahan_full_e": ImplTraits(),
    "exact": ImplTraits(),
    "torch": ImplTraits(triton=False),
}


@dataclass(frozen=True)
class LossConfig:
    """Non-tensor options of one call, resolved and validated (ops/functional.py builds it).

    vocab_size: the full vocabulary (label smoothing averages over it). use_triton: False for the
    PyTorch path. logits_budget: bytes of the one-pass path's logits buffer per token block, for
    the largest shard of any rank (block_vocab).
    one_pass: take it (a gradient is needed, the budget is > 0, the Triton path). need_de / need_dc /
    need_db: which inputs need a gradient. fp32_grads: the one-pass path makes dC and dE in fp32,
    not in the input dtype (reduction "none" once the state saw masked weights). defer_dc: the
    one-pass forward makes dE alone, in fp32, and the backward makes dC and dbias for the upstream
    gradient it gets (reduction "none" once the state saw weights that were no mask).
    """

    impl: str
    softcap: Optional[float]
    label_smoothing: float
    z_loss: float
    vocab_size: int
    use_triton: bool
    kernel: object = None  # kernels.KernelConfig when use_triton
    logits_budget: int = 0
    block_vocab: int = 0  # the largest shard of any rank: sets the one-pass token blocks
    one_pass: bool = False
    need_de: bool = True
    need_dc: bool = True
    need_db: bool = True
    loss_scale: float = 1.0  # the one-pass gradients are made for it (a bf16 dC: ops/upstream.py)
    loss_scale_given: bool = False  # the caller passed it: backwards' reports teach the default nothing
    fp32_grads: bool = False  # the one-pass dC and dE in fp32, as for a main_grad (see masked_weights_seen)
    temperature: float = 1.0  # the logits are divided by it (before the softcap)
    entropy: bool = False  # the forward also gives each token's entropy (sum p z in the statistics)
    defer_dc: bool = False  # dE in the forward (fp32), dC and dbias in the backward (per_token_weights_seen)

    @property
    def traits(self) -> ImplTraits:
        return IMPL_TRAITS[self.impl]


# ----------------------------------------------------------------------------------------------
# collectives


class Collectives:
    """Collectives over the ranks that share one vocabulary. This default is a single process that
    owns all of it; parallel/collectives.py supplies the process-group version.

    `first` marks the one rank that adds the terms which must appear once in a sum over ranks;
    `rank` / `world` place this rank's block of rows under sequence parallelism.
    """

    first = True
    rank = 0
    world = 1

    def all_max_(self, t):
        return t

    def all_sum_(self, t):
        return t

    def gather_rows(self, x):
        """Concatenate every rank's rows (sequence parallelism's all-gather along dim 0)."""
        return x

    def sum_scatter_rows(self, x):
        """Sum over ranks, keep this rank's block of rows (the reduce-scatter along dim 0)."""
        return x


SINGLE = Collectives()


# ----------------------------------------------------------------------------------------------
# shared pieces


def logit_chunk(n: int, v: int, budget: int, bytes_per_logit: int, block_v: int) -> int:
    """Vocabulary columns per chunk: a multiple of block_v whose n x chunk logits fit the budget
    (at least block_v, at most v rounded up)."""
    vc = max(block_v, budget // (max(n, 1) * bytes_per_logit) // block_v * block_v)
    return min(vc, -(-v // block_v) * block_v)


def dense_blocks(n: int, v: int, budget: int, bytes_per_logit: int, block_v: int, min_cols: int):
    """(token rows, vocabulary columns) of one lean-path chunk within `budget` bytes.

    All n tokens go in one block while that leaves at least min_cols columns per chunk; past that
    the tokens are split into equal blocks. Otherwise the chunks would narrow as 1/n, and every
    chunk re-reads e and re-writes the fp32 dE: traffic quadratic in n (at 65,536 tokens of
    Gemma 2 2B that made forward+backward 20x, not 8x, the time of 8,192).
    """
    n = max(n, 1)
    full_v = -(-v // block_v) * block_v
    cols = min(max(min_cols, block_v), full_v)
    most = max(1, budget // (cols * bytes_per_logit))
    rows = -(-n // -(-n // most))  # equal blocks of at most `most` rows
    return rows, logit_chunk(rows, v, budget, bytes_per_logit, block_v)


def fused_one_pass(dtype: torch.dtype, softcap, label_smoothing: float) -> bool:
    """Whether one_pass takes the fused GEMM (its buffer in the input dtype) rather than the
    two-pass variant (fp32 buffer): not for fp16 inputs, nor softcap with label smoothing."""
    return dtype != torch.float16 and not (softcap is not None and label_smoothing > 0)


def token_block(n: int, v: int, budget: int, itemsize: int) -> int:
    """Tokens per one-pass block: equal blocks whose v columns of itemsize bytes fit `budget`."""
    most = max(1, budget // (itemsize * max(v, 1)))
    return max(1, -(-n // -(-max(n, 1) // most)))


def _padded(v: int) -> int:
    # Rows of the one-pass buffer start 32-byte aligned, for the GEMMs' vector loads and stores.
    return -(-v // 8) * 8


def logits_into(out, e, c_rows):
    """out [N, rows] fp32 = e @ c_rows^T, accumulated in fp32 by the library GEMM."""
    if e.dtype == torch.float32:
        torch.mm(e, c_rows.t(), out=out)
    else:
        torch.mm(e, c_rows.t(), out_dtype=torch.float32, out=out)


def _mm_into(out, a, b, *, accumulate: bool, alpha: float = 1.0):
    """out (= or +=) alpha * a @ b in one library GEMM, accumulated in fp32 and rounded to out's
    dtype once; a, b may be strided views."""
    beta = 1.0 if accumulate else 0.0  # beta = 0 never reads out (it may hold garbage)
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=beta, alpha=alpha, out=out)
    elif out.is_cuda:
        torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=out.dtype, out=out)
    else:  # the CPU has no mixed-dtype GEMM: the same arithmetic on fp32 copies
        torch.addmm(out, a.float(), b.float(), beta=beta, alpha=alpha, out=out)


def _combine(mx, se, zt, zsum, comm, dim=None, bad=None, pz=None):
    """Fold partial statistics: the kernel's [S, N] splits (dim=0), or ranks' [N] rows (comm).

    Returns (max, sumexp relative to that max, zt, zsum, pz relative to that max), zsum and pz None
    where not given (pz = sum exp(z - max) z, the entropy's). One MAX and one SUM all-reduce for
    ranks. bad: a _BadTargets whose counts, the first time it comes here, ride along in the SUM.
    """
    m = mx.max(dim=0).values if dim is not None else comm.all_max_(mx.clone())
    safe = torch.where(torch.isfinite(m), m, 0.0)
    factor = torch.exp(mx - safe)
    scaled = se * factor
    pz = pz * factor if pz is not None else None
    parts = [scaled, zt] + [t for t in (zsum, pz) if t is not None]
    if dim is not None:
        packed = [t.sum(dim=0) for t in parts]
    else:
        slots = bad.take() if bad is not None else None
        if slots is None:
            packed = comm.all_sum_(torch.stack(parts))
        else:  # one copy, as the stack is, with the counts' slots after the statistics
            flat = comm.all_sum_(torch.cat([p.reshape(-1) for p in parts] + [slots]))
            packed = flat[: -slots.numel()].view(len(parts), *scaled.shape)
            bad.summed(flat[-slots.numel():])
    rest = iter(packed[2:])
    return (safe, packed[0], packed[1], next(rest) if zsum is not None else None,
            next(rest) if pz is not None else None)


# fp32 holds every integer up to 2^24 exactly: a count travels as two such numbers.
_HALF = 1 << 24


class _BadTargets:
    """Each rank's count of kept targets outside [0, vocab) (counts[1] of the targets' pass) on its
    way to `watch`, as int64 [world] in rank order (ops/functional.py's TargetCheck, whose host copy
    is read once the forward is queued, raises on every rank if any is not 0).

    Every rank must learn every rank's count: a rank that raised alone would leave the others
    waiting in their next collective until the group's timeout. No host sync, and on the one-pass
    path no collective of its own: the counts ride along the first SUM all-reduce of statistics
    (_combine), which follows the first block's GEMM, so that the copy to the host still sits
    ahead of most of the loss's kernels. The lean path all-reduces its statistics only after all of
    its GEMMs, and the host's check would wait for those (the GPU then idles until the backward is
    queued): there the counts take a small all-reduce of their own, queued before the GEMMs
    (send_now).

    A count travels as two fp32 numbers below 2^24 (exact up to 2^48) in this rank's two slots of
    a [2 * world] vector that is 0 elsewhere, so that its sum over the ranks is exact too.
    """

    def __init__(self, counts: torch.Tensor, comm: Collectives, watch: Callable[[torch.Tensor], None]):
        self.watch, self.world = watch, comm.world
        self.slots = None
        mine = counts[1:]
        if comm.world == 1:
            watch(mine)
        else:
            halves = torch.cat([mine // _HALF, mine % _HALF]).float()
            self.slots = torch.nn.functional.pad(halves, (2 * comm.rank, 2 * (comm.world - 1 - comm.rank)))

    def take(self) -> Optional[torch.Tensor]:
        """The slots to sum over the ranks, the first time only (None after, and with one rank)."""
        slots, self.slots = self.slots, None
        return slots

    def summed(self, slots: torch.Tensor):
        """slots summed over the ranks: every rank's count goes to watch."""
        pairs = slots.view(self.world, 2).long()
        self.watch(pairs[:, 0] * _HALF + pairs[:, 1])

    def send_now(self, comm: Collectives):
        """The counts in an all-reduce of their own (the lean path)."""
        slots = self.take()
        if slots is not None:
            self.summed(comm.all_sum_(slots))

    def without_tokens(self):
        """A call without tokens makes no all-reduce of statistics, and has no bad targets on any
        rank (they all have as many targets, parallel/vocab.py checks): this rank's 0 will do."""
        slots = self.take()
        if slots is not None:
            self.summed(slots)


def token_loss(lse, zt, zsum, cfg: LossConfig):
    ls = cfg.label_smoothing
    loss = lse - (1.0 - ls) * zt
    if zsum is not None:
        loss = loss - (ls / cfg.vocab_size) * zsum
    if cfg.z_loss:
        loss = loss + cfg.z_loss * lse * lse
    return loss


def entropy_coefficients(a, g_entropy, mean_z, cfg: LossConfig):
    """(A + k E[z], k) for the entropy's upstream gradient k (times 1 / temperature, as A is)."""
    k = g_entropy * (1.0 / cfg.temperature) if cfg.temperature != 1.0 else g_entropy
    return (a + k * mean_z).contiguous(), k.contiguous()


def coefficients(g_loss, g_lse, lse, cfg: LossConfig):
    """Per-token A, B, U of d loss / d z (see the module docstring), times 1 / temperature (d z /
    d x, before the softcap's factor, which the kernels apply); U is None without smoothing."""
    if cfg.temperature != 1.0:
        g_loss = g_loss * (1.0 / cfg.temperature)
        g_lse = g_lse * (1.0 / cfg.temperature) if g_lse is not None else None
    a = g_loss * (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss else g_loss.clone()
    if g_lse is not None:
        a = a + g_lse
    b = g_loss * (1.0 - cfg.label_smoothing)
    u = g_loss * (cfg.label_smoothing / cfg.vocab_size) if cfg.label_smoothing > 0 else None
    return a.contiguous(), b.contiguous(), u
