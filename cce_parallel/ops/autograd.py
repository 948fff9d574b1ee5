"""The CCE autograd.Function and the drivers that feed the kernels (or the PyTorch reference).

Per token, with z the (soft-capped) logits over the vocabulary and lse their log-sum-exp:

    loss = lse - (1 - ls) * z[target] - (ls / V) * sum_v z_v + z_loss * lse**2

so that, for upstream gradients g (of loss) and h (of lse),

    d/dz_v = A p_v - B [v == target] - U,   A = g (1 + 2 z_loss lse) + h,  B = g (1 - ls),  U = g ls / V.

Two paths, built from GEMMs that accumulate in fp32 (the library's, and one Triton GEMM with the
softmax in its epilogue, kernels/probs_gemm.py) and Triton passes over fp32 logits
(kernels/from_logits.py):

- One pass (the default whenever a gradient is needed): tokens go in blocks whose logits over the
  whole local vocabulary fit `logits_budget` (in the input dtype). Per block: the fused GEMM writes
  W = exp(z - ref) of X = E_b C^T and per-row sums; those (and, under tensor parallelism, their
  all-reduce) give lse and the loss; per-row scalars (one Triton pass, kernels.grad_rows) make W
  the logit gradient G, for g = grad_scale on every kept token (0 on ignored ones); then
  dE_b = G C and dC += G^T E_b. That is three logit-sized GEMMs in all, the fewest an exact method
  needs. The backward only scales these by the upstream gradient g / grad_scale, which is exact
  when g is one number over the kept tokens (reduction mean or sum, or Megatron's loss_mask /
  count with the mask folded into ignore_index, where the ratio is 1 and nothing moves), except
  for a bf16 dC or dE, rounded once already: a ratio that is not a power of two has them
  recomputed (kernels.snap_ratio decides on the device, kernels.weighted_grads recomputes), and
  the forwards after make them for that number (loss_scale below). An fp32 dE, linear in g per
  token, scales per row whatever g is. What a per-token g is over the kept tokens is decided on
  the device, without a host sync (_weights_over_kept): one number, as above; otherwise
  kernels.weighted_grads recomputes dC, dbias and a bf16 dE (exact), and the host learns the kind
  (a call later, on a GPU). Any weights but a mask: later per-token calls take the lean path. One
  number r and 0 on m tokens (Megatron's loss_mask / count with the mask not folded): later
  per-token calls make dC and dE in fp32 (masked_weights_seen). Once the host knows of either,
  per-token backwards sort their weights in one host sync (_weights_kind); for a mask dC and dbias
  become r (dC - the m rows' part), that part recomputed by the lean backward on those m rows
  alone, so that the cost follows m. A gradient
  through the
  returned lse recomputes all.
- Lean (logits_budget=0, nothing needing a gradient, and the fallbacks above): the forward folds
  fp32 logit chunks into the statistics; the backward recomputes them and adds dE and dC chunk by
  chunk. Four logit-sized GEMMs, memory within about 100 MB of dE + dC.

Accumulation: dE is summed in fp32 over the vocabulary (and over tensor-parallel ranks) and
rounded once: in the forward where dC is bf16 and no other rank adds to it (no fp32 dE is kept
then: on a one-block head that is the difference between torch.compile's peak and 48 MiB above
it, Phi 3.5 mini), else in the backward. dC is summed over the token blocks in the input dtype by the dC GEMMs themselves,
except for the batch's target rows, which are summed in fp32 outside dC and rounded into it once
with their target term (one_pass, kernels/target_rows.py): summing those in bf16 too measured worse
than plain bf16 PyTorch (docs/accuracy.md). Into Megatron's main_grad dC is summed in fp32 and
added at backward; so it is for the two-pass variant and label smoothing. Nothing is filtered: on
realistic data block sparsity is too low for skipping to pay (docs/internals.md, "Gradient filtering").
Everything is deterministic: library GEMMs and kernels without atomics.

Under tensor parallelism each rank holds a shard of the vocabulary. Per token (block), the ranks
combine their max with one all-reduce (MAX) and their rescaled sums, target logits and logit sums
with one more (SUM); dE is a partial sum, reduced in fp32; dC / dbias stay local. Each rank's count
of targets outside the vocabulary goes to every rank with the first SUM (on the lean path in a
small all-reduce of its own: _BadTargets), so that they all raise. Inputs here are
already validated and flattened to [N, D] (ops/functional.py does that). Ignored tokens go
through the kernels with zero weight rather than being removed first: removing them needs their
count on the host, a sync that leaves the GPU idle while the host prepares the launches. This
module never imports torch.distributed: parallel/ passes in the collectives.
"""

import math
import warnings
from dataclasses import dataclass
from numbers import Real
from typing import Callable, Optional

import torch

from cce_parallel.ops import reference


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
    not in the input dtype (reduction "none" once masked weights were seen: masked_weights_seen).
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
    loss_scale: float = 1.0  # the one-pass gradients are made for it (a bf16 dC: see loss_scale below)
    fp32_grads: bool = False  # the one-pass dC and dE in fp32, as for a main_grad (see masked_weights_seen)

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


def _combine(mx, se, zt, zsum, comm, dim=None, bad=None):
    """Fold partial statistics: the kernel's [S, N] splits (dim=0), or ranks' [N] rows (comm).

    Returns (max, sumexp relative to that max, zt, zsum). One MAX and one SUM all-reduce for ranks.
    bad: a _BadTargets whose counts, the first time it comes here, ride along in the SUM.
    """
    m = mx.max(dim=0).values if dim is not None else comm.all_max_(mx.clone())
    safe = torch.where(torch.isfinite(m), m, 0.0)
    scaled = se * torch.exp(mx - safe)
    if dim is not None:
        return safe, scaled.sum(dim=0), zt.sum(dim=0), zsum.sum(dim=0) if zsum is not None else None
    parts = [scaled, zt] + ([zsum] if zsum is not None else [])
    slots = bad.take() if bad is not None else None
    if slots is None:
        packed = torch.stack(parts)
        comm.all_sum_(packed)
    else:  # one copy, as the stack is, with the counts' slots after the statistics
        flat = comm.all_sum_(torch.cat([p.reshape(-1) for p in parts] + [slots]))
        packed = flat[: -slots.numel()].view(len(parts), *scaled.shape)
        bad.summed(flat[-slots.numel():])
    return safe, packed[0], packed[1], packed[2] if zsum is not None else None


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


def coefficients(g_loss, g_lse, lse, cfg: LossConfig):
    """Per-token A, B, U of d loss / d z (see the module docstring); U is None without smoothing."""
    a = g_loss * (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss else g_loss.clone()
    if g_lse is not None:
        a = a + g_lse
    b = g_loss * (1.0 - cfg.label_smoothing)
    u = g_loss * (cfg.label_smoothing / cfg.vocab_size) if cfg.label_smoothing > 0 else None
    return a.contiguous(), b.contiguous(), u


def _stats_of_block(x, bias, targets, cfg, comm, bad=None):
    """Global (max, sumexp, zt, zsum) of the tokens whose fp32 logits over the whole local
    vocabulary are x [k, V]: one statistics pass, then the ranks' all-reduces (_combine's `bad`)."""
    from cce_parallel import kernels

    k, v = x.shape
    need_zsum = cfg.label_smoothing > 0
    slices = kernels.stats_slices(k, v, cfg.kernel, x.is_cuda)
    f32 = dict(device=x.device, dtype=torch.float32)
    mx = torch.empty((slices, k), **f32)
    se, zt = torch.empty((slices, k), **f32), torch.empty((slices, k), **f32)
    zsum = torch.empty((slices, k), **f32) if need_zsum else None
    kernels.stats_from_logits(
        x, bias, targets, cfg.softcap, mx, se, zt, zsum, split=0, slices=slices, v_lo=0, v_hi=v, config=cfg.kernel
    )
    return _combine(*_combine(mx, se, zt, zsum, SINGLE, dim=0), comm, bad=bad)


# ----------------------------------------------------------------------------------------------
# the one-pass path


def one_pass(e, c, bias, targets, start, prepare, watch, cfg: LossConfig, comm, *, main_grad: bool = False):
    """(lse, zt, zsum, dE, dC, dbias, prepared) with the gradients of sum_t g[t] * loss[t]: dE the
    fp32 partial sum over this rank's vocabulary (in e's dtype, rounded once, where dC is and the
    call has one rank: de_dtype below), dbias fp32, dC in c's dtype (fp32 where it goes into an
    fp32 `main_grad`, and on the paths dc_dtype below names); None where not needed. See the
    module docstring.

    targets: the caller's (flat, contiguous), rows of c being vocabulary rows start ...
    prepare(): the targets' pass, prepared = (each token's row of c or -1, keep, counts,
    grad_scale) as LinearCrossEntropyFunction takes them; g = keep * grad_scale (0 at ignored
    tokens, whose gradients are thus 0). It is called once the first block's fused GEMM is queued:
    the host's work before that GEMM is the GPU's idle time at the start of a call (on an H100,
    the targets' pass and its check took 0.3-0.4 ms of host time there; Phi 3.5 mini's loss and
    gradients take 7.5 ms). watch: gets every rank's count of bad targets (_BadTargets), after the
    first block's all-reduce.

    Per block the fused GEMM writes W = exp(z - ref) (times the softcap's 1 - tanh^2) in the input
    dtype, ref being a per-row offset it picks within 44.4 nats of the row's largest logit on this
    rank (so nothing overflows, and nothing needs checking on the host). The
    ranks combine their offsets like partial maxima: with M the largest, r = exp(ref - M) and
    S = sum r sum exp(z - ref) over the whole vocabulary, lse = M + log S and, per token,
    w = A r / S, the logit gradient is w W - B' [v == target] - U, so that dE = w (W C) - B'
    C[target] (fp32, exact scaling) and dC += W^T (w E) - scatter of B' E over the targets (w E
    rounded to the input dtype once, as the logit gradient itself is in plain PyTorch; the target
    term in fp32, or folded into W's entry where the target's p >= 1/2: see _fused_products).
    fp16 inputs take the two-pass variant instead (W would pass fp16's range): fp32 logits from
    the library GEMM, a statistics pass for lse, then the logit gradient in place; so does softcap
    with label smoothing (its uniform term gets the softcap's factor per entry, which W cannot
    carry).
    """
    from cce_parallel import kernels

    n, d = e.shape
    v = c.shape[0]
    f32 = dict(device=e.device, dtype=torch.float32)
    fused = fused_one_pass(e.dtype, cfg.softcap, cfg.label_smoothing)
    uniform = cfg.label_smoothing > 0
    # The same token blocks on every rank (each block's statistics are all-reduced), sized by the
    # largest shard.
    buf_dtype = e.dtype if fused else torch.float32
    nt = token_block(n, max(v, cfg.block_vocab), cfg.logits_budget, buf_dtype.itemsize)
    lse = torch.empty(n, **f32)
    zt = (torch.zeros if fused else torch.empty)(n, **f32)  # the fused GEMM writes targets it holds
    first_stats = None
    if fused and n > 0:
        buf = torch.empty((nt, _padded(v)), device=e.device, dtype=buf_dtype)
        k = min(n, nt)
        first_stats = kernels.logits_probs(e[:k], c, bias, targets[:k], start, buf[:k, :v], zt[:k],
                                           softcap=cfg.softcap, need_zsum=uniform, config=cfg.kernel)
    prepared = prepare()
    bad = _BadTargets(prepared[2], comm, watch)  # sent with the first block's statistics
    raw, targets = targets, prepared[0]
    g_rows = torch.mul(prepared[1], prepared[3])
    zsum = torch.empty(n, **f32) if uniform else None
    # dC in c's dtype on the fused path without a uniform term: the first block's GEMM writes it,
    # later blocks' GEMMs add to it (each rounded once). The batch's target rows, where the target
    # term cancels much of the GEMM's sum, are kept out of that: before each later block they move
    # into an fp32 buffer (kernels.fold_rows), so each holds an fp32 sum of once-rounded block
    # parts, to which the target term is added in fp32 and which is rounded into dC once at the
    # end. That is at least as accurate as one block and as plain bf16 PyTorch
    # (docs/accuracy.md), and needs no V x D fp32 sum. Into Megatron's fp32 main_grad dC goes unrounded,
    # as Megatron's own weight gradient does; the two-pass variant, label smoothing and fp32
    # inputs sum in fp32 (the target term added per block, as into main_grad).
    low = fused and not uniform and not main_grad and c.dtype != torch.float32
    dc_dtype = c.dtype if low else torch.float32
    # dE likewise in the input dtype, each row rounded once from fp32 (its block's fp32 rows sit in
    # memory the block has done with: _rounded_de), where no rank's partial sum remains to be added.
    de_dtype = e.dtype if low and comm.world == 1 else torch.float32
    # Every block writes its rows of dE; the first block writes dC (beta = 0), later ones add.
    alloc = torch.empty if n > 0 and v > 0 else torch.zeros
    de = alloc((n, d), device=e.device, dtype=de_dtype) if cfg.need_de else None
    dc = alloc((v, d), device=c.device, dtype=dc_dtype) if cfg.need_dc else None
    db = torch.zeros(v, **f32) if cfg.need_db else None
    if n == 0 or v == 0:
        bad.without_tokens()
        return lse, zt, zsum, de, dc, db, prepared
    # -U * sum over this rank's vocabulary of C (dE) and -sum_t U_t E_t on every row of dC (added once).
    csum = c.sum(dim=0, dtype=torch.float32) if fused and uniform and de is not None else None
    u_rows = torch.zeros(d, **f32) if fused and uniform and dc is not None else None
    if not fused:
        buf = torch.empty((nt, _padded(v)), device=e.device, dtype=buf_dtype)
    # bf16 dC: each token's target term coefficient, and over several blocks the target rows' sums.
    b_all = torch.empty(n, **f32) if low and dc is not None else None
    slots = None  # made before the second block, so that the first one's GEMMs start sooner
    # A bf16 dE over several blocks: each block's fp32 rows in one buffer, its GEMM whole (split in
    # three, as one block's is to keep no fp32 rows at all, the GEMMs of 683-token parts made Llama 3
    # 8B's call 2 % slower on an H100).
    de_tmp = torch.empty((nt, d), **f32) if de is not None and de.dtype != torch.float32 and nt < n else None
    # Per block, the fused path's row factors w and B' (see _fused_products).
    w_rows = torch.empty(nt, **f32) if fused else None
    b_rows = torch.empty(nt, **f32) if fused and b_all is None else None
    # The two-pass variant's fp16 logit gradients are stored times a power of two that brings the
    # largest per-token weight (grad_scale) near 1: one scale for all blocks, divided out at the end.
    if fused:
        scale = None
    elif e.dtype == torch.float16:
        scale = kernels.grad_scale(g_rows, g_rows)  # from the weights: no block's lse is known yet
    else:
        scale = torch.ones(1, **f32)
    for t0 in range(0, n, nt):
        rows = slice(t0, min(n, t0 + nt))
        x = buf[: rows.stop - t0, :v]
        e_b, t_b = e[rows], targets[rows]
        if fused:
            if b_all is not None and t0 > 0:
                if slots is None:
                    slots = _TargetRows(targets, v, d)
                slots.fold(dc, back=False)  # the target rows' sums so far leave dC
            if t0 == 0:
                ref, s, zs = first_stats
            else:
                ref, s, zs = kernels.logits_probs(e_b, c, bias, raw[rows], start, x, zt[rows],
                                                  softcap=cfg.softcap, need_zsum=uniform, config=cfg.kernel)
            m = ref
            if comm.world > 1:  # the ranks' statistics: one MAX and one SUM all-reduce
                m, s, zt[rows], zs = _combine(ref, s, zt[rows], zs, comm, bad=bad)
            if zsum is not None:
                zsum[rows] = zs
            k = rows.stop - t0
            _fused_products(
                x, ref, m, s, e_b, c, t_b, g_rows[rows], cfg, lse[rows], zt[rows], w_rows[:k],
                b_all[rows] if b_all is not None else b_rows[:k], de[rows] if de is not None else None, dc, db,
                csum, u_rows, first=t0 == 0, dc_target=b_all is None, de_tmp=de_tmp[:k] if de_tmp is not None else None,
            )
            continue
        logits_into(x, e_b, c)
        m, se, zt[rows], zs = _stats_of_block(x, bias, t_b, cfg, comm, bad)
        lse[rows] = m + torch.log(se)
        if zsum is not None:
            zsum[rows] = zs
        _two_pass_products(x, e_b, c, bias, t_b, g_rows[rows], scale, cfg, lse[rows],
                           de[rows] if de is not None else None, dc, db, first=t0 == 0)
    del buf, x  # x, the last block's view, would keep the buffer alive past here
    if e.dtype == torch.float16 and not fused:
        for t in (de, dc, db):  # the products' power-of-two scale, divided out once (exact)
            if t is not None:
                t.div_(scale)
    if b_all is not None:
        # The target term, each target row's sum in fp32, rounded into dC once (with the row's
        # block parts over several blocks).
        if slots is None:
            kernels.add_rows_summed(dc, targets, e, b_all.neg_())  # targets of -1 are skipped
        else:
            kernels.add_rows_summed(slots.acc, slots.slot, e, b_all.neg_())
            slots.fold(dc, back=True)
    if u_rows is not None:
        dc.sub_(u_rows.to(dc.dtype)[None, :])
    return lse, zt, zsum, de, dc, db, prepared


def _fused_products(w_mat, ref, m, s, e, c, targets, g_rows, cfg, lse, zt, w, b, de_rows, dc, db, csum, u_rows,
                    *, first, dc_target, de_tmp=None):
    """dE rows, dC and dbias of one block from W = exp(z - ref) and the statistics over the whole
    vocabulary (m, s: see kernels.grad_rows, which writes lse and the per-token w and B' into the
    given [k] buffers): the gradient is w W - B' [target] - U. Where the target is unlikely (p <
    1/2) its term stays out of W: rounded into W's target entry it would lose 2^-9 of what is, for
    an untrained model, most of each row's gradient. It is added in fp32 from the target rows of C
    and E instead (kernels.scale_sub_rows into dE; kernels.add_rows_summed into dC, deterministic),
    into dC here where dc_target (an fp32 dC), else by the caller (one_pass) from b: B' per token
    (0 where the target is not in this shard or went into W). A bf16 dE's fp32 rows go into de_tmp
    if given (_rounded_de)."""
    from cce_parallel import kernels

    v = c.shape[0]
    # Products in fp32, each rounded once. dC goes first, so that w E can sit in the memory of dE's
    # rows, which the GEMM below then writes.
    we = None
    if dc is not None:
        we = torch.empty_like(e) if de_rows is None else de_rows.view(-1).view(e.dtype)[: e.numel()].view_as(e)
    kernels.grad_rows(w_mat, ref, m, s, zt, g_rows, targets, lse, w, b, e if we is not None else None, we,
                      softcap=cfg.softcap, z_loss=cfg.z_loss, label_smoothing=cfg.label_smoothing)
    u = g_rows * (cfg.label_smoothing / cfg.vocab_size) if cfg.label_smoothing > 0 else None
    if dc is not None:
        _mm_into(dc, w_mat.t(), we, accumulate=not first)
        if dc_target:  # targets of -1 (another shard's, ignored) are skipped
            kernels.add_rows_summed(dc, targets, e, b.neg())
        if u is not None:
            u_rows.add_(u @ e.float())
    if db is not None:  # before dE, whose rounded variant writes into W
        db.add_(torch.mm(w_mat.t(), w.to(w_mat.dtype)[:, None], **_fp32_out(w_mat)).squeeze(1))
        db.index_put_((targets.clamp(0, v - 1),), -b, accumulate=True)
        if u is not None:
            db.sub_(u.sum())
    if de_rows is not None and de_rows.dtype != torch.float32:
        _rounded_de(w_mat, c, w, b, targets, de_rows, de_tmp)
    elif de_rows is not None:
        _mm_into(de_rows, w_mat, c, accumulate=False)
        kernels.scale_sub_rows(de_rows, w, b, c, targets)
        if u is not None:
            de_rows.addr_(u, csum, alpha=-1.0)


def _fp32_view(t, start: int, end: int, rows: int, d: int):
    """rows x d fp32 in the memory of elements [start, end) of t (contiguous from its storage
    offset), or None where that does not fit or is not 16-byte aligned."""
    size = rows * d * 4 // t.element_size()
    if start + size > end or rows == 0:
        return None
    flat = t.as_strided((size,), (1,), t.storage_offset() + start)
    if flat.data_ptr() % 16:
        return None
    return flat.view(torch.float32).view(rows, d)


def _rounded_de(w_mat, c, w, b, targets, de_rows, tmp=None):
    """de_rows (the input dtype) = w (W C) - B' C[target], the products in fp32 and rounded once.
    With tmp (fp32, shaped like de_rows), the fp32 rows go there. Without, no [k, D] fp32 buffer
    is needed: the GEMM goes in three parts, the first writing its fp32 rows into the last two
    thirds of de_rows' own memory, each later one into the rows of W that the one before has read
    (W is done with: dC and dbias come first). On Phi 3.5 mini's head in one block that keeps the
    call's peak at W + dC + dE as torch.compile's is, instead of 48 MiB above it."""
    from cce_parallel import kernels

    if tmp is not None:
        _mm_into(tmp, w_mat, c, accumulate=False)
        kernels.scale_sub_rows(tmp, w, b, c, targets, out=de_rows)
        return
    k, d = de_rows.shape
    a = k // 3
    b2 = -(-(k - a) // 2)
    parts = ((0, a), (a, a + b2), (a + b2, k))
    rows_w = w_mat.stride(0)  # W's rows are padded to rows_w columns
    homes = None
    if de_rows.is_contiguous() and a > 0:
        homes = [_fp32_view(de_rows, (k - 2 * a) * d, k * d, a, d),
                 _fp32_view(w_mat, 0, a * rows_w, b2, d),
                 _fp32_view(w_mat, a * rows_w, (a + b2) * rows_w, k - a - b2, d)]
    if homes is None or any(h is None for (lo, hi), h in zip(parts, homes) if hi > lo):
        # Small blocks, or a vocabulary under about 2 D: one fp32 buffer.
        tmp = torch.empty((k, d), device=de_rows.device, dtype=torch.float32)
        homes = [tmp[lo:hi] for lo, hi in parts]
    for (lo, hi), home in zip(parts, homes):
        if hi > lo:
            _mm_into(home, w_mat[lo:hi], c, accumulate=False)
    for (lo, hi), home in zip(parts, homes):
        if hi > lo:
            kernels.scale_sub_rows(home, w[lo:hi], b[lo:hi], c, targets[lo:hi], out=de_rows[lo:hi])


class _TargetRows:
    """The distinct targets in [0, v) of a call's tokens, numbered in increasing order without a
    host sync (sorting and prefix sums on the device), and an fp32 row for each: rows [n] int64
    (number -> row of c, -1 past the last), slot [n] int64 (each token's number, -1 for a token
    whose target is not in [0, v): kernels.add_rows_summed skips it), acc fp32 [min(n, v), D]."""

    def __init__(self, targets, v: int, d: int):
        n = targets.numel()
        here = (targets >= 0) & (targets < v)
        ordered, order = torch.sort(torch.where(here, targets, v))
        first = torch.ones_like(here)
        first[1:] = ordered[1:] != ordered[:-1]
        first &= ordered < v
        numbers = (torch.cumsum(first, 0) - 1).clamp_min_(0)
        self.slot = torch.empty_like(numbers).scatter_(0, order, torch.where(ordered < v, numbers, -1))
        rows = torch.full((n + 1,), -1, device=targets.device, dtype=torch.int64)
        rows.scatter_(0, torch.where(first, numbers, n), ordered)  # the others land on rows[n]
        s = min(n, v)
        self.rows = rows[:s]
        self.acc = torch.zeros((s, d), device=targets.device, dtype=torch.float32)

    def fold(self, dc, *, back: bool):
        from cce_parallel import kernels

        kernels.fold_rows(dc, self.acc, self.rows, back=back)


def _two_pass_products(x, e, c, bias, targets, g_rows, scale, cfg, lse, de_rows, dc, db, *, first):
    """dE rows, dC and dbias of one block whose lse is known, times `scale` (fp32 [1]): the logit
    gradient in place, then GEMMs."""
    from cce_parallel import kernels

    a, b, u = coefficients(g_rows, None, lse, cfg)
    g = kernels.dz_rows_in_place(
        x, bias, targets, lse, a, b, u, scale, e.dtype, softcap=cfg.softcap, config=cfg.kernel
    )
    if de_rows is not None:
        _mm_into(de_rows, g, c, accumulate=False)
    if dc is not None:
        _mm_into(dc, g.t(), e, accumulate=not first)
    if db is not None:
        db.add_(g.sum(dim=0, dtype=torch.float32))


def _fp32_out(t):
    return {} if t.dtype == torch.float32 else {"out_dtype": torch.float32}


# ----------------------------------------------------------------------------------------------
# the lean path


class _Partials:
    """The lean forward's [S, N] partial statistics, one row per (vocabulary chunk, column slice).

    At most `rows` rows are kept: when the next chunk would not fit, the rows so far are folded into
    the first one (as _combine does at the end), so that S does not grow with V / chunk."""

    def __init__(self, rows: int, n: int, need_zsum: bool, device):
        f32 = dict(device=device, dtype=torch.float32)
        # Every launched slice writes all its rows (an empty slice writes max -inf, sums 0).
        self.mx = torch.full((rows, n), float("-inf"), **f32)
        self.se, self.zt = torch.zeros((rows, n), **f32), torch.zeros((rows, n), **f32)
        self.zsum = torch.zeros((rows, n), **f32) if need_zsum else None
        self.used = 0

    def reserve(self, k: int) -> int:
        """The first of k free rows."""
        if self.used + k > self.mx.shape[0]:
            mx = self.rows()[0]
            m = mx.max(dim=0).values  # the true max: _combine's is 0 where it is not finite
            _, self.se[0], self.zt[0], zsum = _combine(*self.rows(), SINGLE, dim=0)
            self.mx[0] = m
            if zsum is not None:
                self.zsum[0] = zsum
            self.used = 1
        first, self.used = self.used, self.used + k
        return first

    def rows(self):
        u = max(self.used, 1)
        return self.mx[:u], self.se[:u], self.zt[:u], self.zsum[:u] if self.zsum is not None else None


def local_stats(e, c, bias, targets, cfg: LossConfig):
    """(max, sumexp, zt, zsum) of each token over the rows of c (this rank's shard), from fp32 logit
    chunks of at most fwd_chunk_bytes: vocabulary chunks, each over blocks of tokens."""
    need_zsum = cfg.label_smoothing > 0
    if not cfg.use_triton:
        return reference.forward_stats(e, c, bias, targets, cfg.softcap, need_zsum=need_zsum)
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, v = e.shape[0], c.shape[0]
    nt, vc = dense_blocks(n, v, kcfg.fwd_chunk_bytes, 4, kcfg.fwd_block_v, kcfg.dense_min_cols)
    slices = kernels.stats_slices(nt, vc, kcfg, e.is_cuda)
    # Room for a quarter of the chunk budget, and at least two chunks' rows.
    cap = max(2 * slices, min(max(1, -(-v // vc)) * slices, kcfg.fwd_chunk_bytes // 4 // (16 * max(n, 1))))
    part = _Partials(cap, n, need_zsum, e.device)
    if n > 0 and v > 0:
        x = torch.empty((nt, vc), device=e.device, dtype=torch.float32)
        for lo in range(0, v, vc):
            hi = min(v, lo + vc)
            split = part.reserve(slices)
            for t0 in range(0, n, nt):
                t1 = min(n, t0 + nt)
                xs = x[: t1 - t0, : hi - lo]
                logits_into(xs, e[t0:t1], c[lo:hi])
                cols = slice(t0, t1)
                kernels.stats_from_logits(
                    xs, bias, targets[cols], cfg.softcap, part.mx[:, cols], part.se[:, cols], part.zt[:, cols],
                    part.zsum[:, cols] if need_zsum else None, split=split, slices=slices, v_lo=lo, v_hi=hi,
                    config=kcfg,
                )
    return _combine(*part.rows(), SINGLE, dim=0)


def lean_backward(e, c, bias, targets, lse, a, b, u, cfg: LossConfig, need_de=True, dc_out=None):
    """(dE fp32 partial over this rank's vocabulary or None, dC in c's dtype, dbias fp32 or None):
    per vocabulary chunk and block of tokens, the library GEMM recomputes the fp32 logits, one
    Triton pass turns them into the logit gradient (input dtype), and GEMMs add it to dE (fp32) and
    dC. dC is summed over all tokens before it is rounded: in one GEMM when the tokens form one
    block, else in an fp32 buffer of one chunk's rows. dc_out: an fp32 [V, D] tensor that dC is
    added to (not rounded) and returned as dC, or None."""
    if not cfg.use_triton:
        de, dc, db = reference.backward(e, c, bias, targets, lse, a, b, u, cfg.softcap, dc_out=dc_out)
        return (de if need_de else None), dc, db
    from cce_parallel import kernels

    kcfg = cfg.kernel
    n, d = e.shape
    v = c.shape[0]
    f32 = dict(device=e.device, dtype=torch.float32)
    de = torch.zeros(e.shape, **f32) if need_de else None
    db = torch.zeros(v, **f32) if bias is not None else None
    if n == 0:
        return de, dc_out if dc_out is not None else torch.zeros_like(c), db
    # The budget holds a chunk's fp32 logits and its logit gradient. With several token blocks, dC
    # is summed in an fp32 buffer of the chunk's rows (dense_min_cols x D floats, ~9 MB at D=2304).
    nt, vc = dense_blocks(n, v, kcfg.bwd_workspace_bytes, e.element_size() + 4, kcfg.bwd_block_v, kcfg.dense_min_cols)
    split = nt < n
    dc = torch.empty_like(c) if dc_out is None else dc_out
    ws = torch.empty((nt, vc), device=e.device, dtype=e.dtype)
    x = torch.empty((nt, vc), **f32)
    dc_sum = torch.empty((vc, d), **f32) if split else None
    # fp16 logit gradients are scaled by a power of two (kernels.grad_scale); 1 otherwise.
    fp16 = e.dtype == torch.float16
    scale = kernels.grad_scale(a, b, u) if fp16 else torch.ones(1, **f32)
    add = dc_out is not None
    for lo in range(0, v, vc):
        hi = min(v, lo + vc)
        for t0 in range(0, n, nt):
            rows = slice(t0, min(n, t0 + nt))
            k = rows.stop - t0
            g = ws[:k, : hi - lo]
            logits_into(x[:k, : hi - lo], e[rows], c[lo:hi])
            kernels.dz_from_logits(
                x[:k, : hi - lo], bias, targets[rows], lse[rows], a[rows], b[rows],
                u[rows] if u is not None else None, scale, ws[:k], softcap=cfg.softcap, v_lo=lo, v_hi=hi,
                config=kcfg,
            )
            if de is not None:
                if fp16:
                    de[rows] += torch.mm(g, c[lo:hi], out_dtype=torch.float32).div_(scale)
                else:
                    _mm_into(de[rows], g, c[lo:hi], accumulate=True)
            if split:
                _mm_into(dc_sum[: hi - lo], g.t(), e[rows], accumulate=t0 > 0)
            elif fp16:
                part = torch.mm(g.t(), e[rows], out_dtype=torch.float32).div_(scale)
                dc[lo:hi] = dc[lo:hi] + part if add else part
            elif add:
                _mm_into(dc[lo:hi], g.t(), e[rows], accumulate=True)
            else:
                torch.mm(g.t(), e[rows], out=dc[lo:hi])  # fp32 accumulation, rounded once
            if db is not None:
                db[lo:hi] += g.sum(dim=0, dtype=torch.float32).div_(scale)
        if split:
            part = dc_sum[: hi - lo].div_(scale)
            dc[lo:hi] = dc[lo:hi] + part if add else part
    return de, dc, db


# ----------------------------------------------------------------------------------------------
# the Function

# What the host has learned of earlier backwards' upstream gradients:
#
# per_token_weights_seen: a per-token loss's backward got weights that were neither one number nor
# one number and 0 over the kept tokens (_MANY). From then on, reduction "none" takes the lean path
# (ops/functional.py), which computes them with no wasted work.
# masked_weights_seen: a per-token loss's backward got one number and 0 over the kept tokens (_MASK:
# Megatron's (loss * loss_mask).sum() / count with the mask not folded into ignore_index). From then
# on, reduction "none" makes dC and dE in fp32 in the forward (LossConfig.fp32_grads) and sorts the
# weights in the backward on the host, so that a mask's backward subtracts the masked rows' part.
# Both are learned from the device's report (read_backward_reports): training loops call the loss
# the same way every step, so only the first call (on a GPU the first two) recomputes all.
#
# loss_scale: the number the one-pass forward makes a bf16 dC and dE for (no fp32 main_grad), times
# the reduction's own weights: what the caller multiplies the reduced loss by before the backward
# (1 / micro-batches in Megatron's schedule). The backward scales the stored gradients by the
# upstream gradient over that; a bf16 gradient scaled by a number that is not a power of two would
# be rounded a second time (worse than plain bf16 PyTorch), so there kernels.weighted_grads
# recomputes it (exact, slow) and the host learns the number for later calls (read_backward_reports:
# on a GPU from the second call after). expect_loss_scale sets it beforehand.
# loss_scale_unsteady: the number changed between two backwards in a row (loss sites with different
# weights, say): bf16-dC calls take the lean path from then on, exact for any upstream gradient.
per_token_weights_seen = False
masked_weights_seen = False
loss_scale = 1.0
loss_scale_unsteady = False
_last_missed = False  # the last report was a miss (loss_scale is the number it brought)

# Reports of backwards on a GPU not yet read on the host: (pinned fp32 [2] = (code, ratio), event,
# the loss_scale its forward used). code: the per-token weights' kind (_ONE, _MANY, _MASK), plus
# _MISSED where the number's ratio to loss_scale is not a power of two (a bf16 dC / dE recomputed).
_reports: list = []


def expect_loss_scale(scale: float) -> None:
    """Tell the loss what the reduced loss will be multiplied by before its backward (for example
    1 / micro-batches where the loss is divided by their number), so that a bf16 dC computed in
    the forward is made for it: rounded once, with no recompute at the first backward. Without it
    the loss learns the number from its backwards. Calls made before and after a resume then
    compute the same bits (the train job sets it). It also ends an "unsteady" state (changing
    numbers sent bf16 calls down the lean path): the one-pass path is taken again, until two
    different numbers in a row are seen again."""
    global loss_scale, loss_scale_unsteady, _last_missed
    if not (isinstance(scale, Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale != 0):
        raise ValueError(f"expect_loss_scale: scale must be a finite nonzero number, got {scale!r}")
    loss_scale, loss_scale_unsteady, _last_missed = float(scale), False, False


def _warn_many():
    global per_token_weights_seen
    if not per_token_weights_seen:
        per_token_weights_seen = True
        warnings.warn(
            "cce_parallel: a per-token loss's upstream gradient was neither one number nor one number and 0 over "
            "the kept tokens, so the gradients computed in the forward could not just be scaled; they were "
            "recomputed (exact, slower). Later calls with reduction='none' in this process take the lean path "
            "(logits_budget='lean').",
            stacklevel=3,
        )


def _learn_scale(value: float):
    """A backward's upstream number was `value` (times the reduction's weights), not loss_scale."""
    from cce_parallel import kernels

    global loss_scale, loss_scale_unsteady, _last_missed
    near = kernels.SNAP_ULPS * 2.0**-23 * abs(loss_scale)  # two numbers this close are one, as in snap_ratio
    if _last_missed and abs(value - loss_scale) > near and not loss_scale_unsteady:
        loss_scale_unsteady = True
        warnings.warn(
            f"cce_parallel: the loss's upstream gradient changed between backwards ({loss_scale:g}, then "
            f"{value:g}: loss sites with different weights?). A bf16 dC made in the forward would be rounded twice, "
            "so calls without an fp32 main_grad take the lean path from now on (exact, slower). One loss scale "
            "per process (cce_parallel.expect_loss_scale) keeps the one-pass speed.",
            stacklevel=4,
        )
    loss_scale, _last_missed = value, True


_ONE, _MANY, _MASK = 0, 1, 2  # the per-token weights' kinds, as the device reports them
_MISSED = 4  # added to the report's code: a loss scale whose ratio is not a power of two


def _weights_over_kept(w: torch.Tensor, keep: torch.Tensor):
    """(ratio, kind) of the per-token weights w over the kept tokens, on the device: kind int32 [1]
    _ONE where they are one number (ratio, 0-dim fp32, that number; 0 where all are 0 or nothing is
    kept), _MASK where they are 0 on some and one number on the others, _MANY otherwise (NaN
    included); ratio 0 unless _ONE. No host sync: Megatron's (loss * mask).sum() / count with the
    mask folded into ignore_index takes this path on every call, and a sync there leaves the GPU
    idle until the host queues its next work."""
    if not w.numel():  # no tokens: zero gradients
        return w.new_zeros(()), torch.zeros(1, device=w.device, dtype=torch.int32)
    inf = float("inf")
    nonzero = keep & (w != 0)  # NaN counts as nonzero: amin / amax propagate it
    lo, hi = torch.where(nonzero, w, inf).amin(), torch.where(nonzero, w, -inf).amax()
    zeros = (keep & (w == 0)).any()
    none = lo == inf
    same = lo >= hi  # False where NaN
    kind = torch.where(none | (same & ~zeros), _ONE, torch.where(same, _MASK, _MANY))
    ratio = torch.where(none | (kind != _ONE), 0.0, lo)
    return ratio, kind.to(torch.int32).reshape(1)


def _weights_kind(w: torch.Tensor, keep: torch.Tensor):
    """(kind, r) of the per-token weights w over the kept tokens, in one host sync: ("one", r) where
    they all equal r (0 where all are 0 or nothing is kept); ("mask", r) where they are 0 on some
    and r on all the others; ("many", None) otherwise, NaN included (it must reach the gradients)."""
    if not w.numel():
        return "one", 0.0
    inf = float("inf")
    nonzero = keep & (w != 0)  # NaN counts as nonzero: amin / amax propagate it
    lo, hi, zeros = torch.stack([torch.where(nonzero, w, inf).amin().double(),
                                 torch.where(nonzero, w, -inf).amax().double(),
                                 (keep & (w == 0)).sum().double()]).tolist()
    if lo == inf:
        return "one", 0.0
    if lo != hi:  # NaN too
        return "many", None
    return ("mask" if zeros else "one"), lo


def _saw_masked():
    global masked_weights_seen
    masked_weights_seen = True


def _report(packed: torch.Tensor, used: float):
    """Send a backward's report (fp32 [2] = code, ratio; kernels.snap_ratio) to the host: at once on
    a CPU; on a GPU through a pinned copy that the next call of the loss reads after its forward
    (read_backward_reports). Every tensor-parallel rank gets the same upstream gradient, so they
    all learn the same at the same call."""
    if packed.is_cuda:
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        _reports.append((host, event, used))
    else:
        _reports.append((packed, None, used))
        read_backward_reports()


def read_backward_reports():
    """What earlier backwards reported (_report), in their order; ops/functional.py calls this
    after each call's forward has waited for its targets' counts, which the stream orders after
    the earlier backwards' reports: on a GPU the host learns a backward's report one call late."""
    global _last_missed
    while _reports:
        host, event, used = _reports.pop(0)
        if event is not None:
            event.synchronize()
        code, ratio = host.tolist()
        kind, missed = int(code) % _MISSED, code >= _MISSED
        if kind == _MANY:
            _warn_many()
        elif kind == _MASK:
            _saw_masked()
        if missed:
            _learn_scale(ratio * used)
        else:
            _last_missed = False


def _scaled(t, ratio, dtype):
    """t (fp32, or a dC made in c's dtype) * ratio (a 0-dim fp32 tensor) in `dtype`, with no host
    sync: in place when t has that dtype (the kernel moves nothing when ratio is 1 on the device,
    as it is for a mean, a sum or Megatron's loss_mask / count); else one Triton pass into a new
    tensor (torch.mul into a narrower dtype takes twice as long)."""
    if t is None:
        return None
    from cce_parallel import kernels

    if t.dtype == dtype:
        return kernels.scale_(t, ratio)
    return kernels.scaled_copy(t, ratio, dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss and log-sum-exp, fp32, for all n tokens (0 at ignored ones), and the targets'
    counts (int64 [2], the first the number of kept tokens).

    e: [n_rows, D] (this rank's rows under sequence parallelism, else all n); c: [V_shard, D], rows
    start .. start + V_shard of the vocabulary; bias: [V_shard] or None; targets: [n], the
    caller's, flat and contiguous; prepare(): the targets' pass (ops/functional.py), returning
    (each token's row of c or -1 where another rank holds it or it is ignored, keep [n] bool: the
    tokens that count, counts: int64 [2], kept tokens and kept ones outside [0, vocab), grad_scale:
    fp32 [], 1 / kept for reductions "mean" and "none", 1 for "sum", times cfg.loss_scale). The
    one-pass gradients are those of grad_scale * the kept tokens' loss, so that the usual upstream
    gradient, a mean's or Megatron's loss_mask / count (times the expected loss scale), leaves
    nothing to rescale. watch(bad): called once in the forward with every rank's count of kept
    targets outside [0, vocab) (int64 [world], on the device; see _BadTargets), for the caller to
    check on the host once the forward is queued.
    Ignored tokens go through the kernels with zero weight: no host sync decides which tokens
    count. c_main_grad: None, or a callable returning a buffer shaped like c into which the
    backward adds dC (Megatron's gradient-accumulation fusion); c then gets no gradient from the
    Function.
    """

    @staticmethod
    def forward(ctx, e, c, bias, targets, start: int, prepare: Callable, watch: Callable, cfg: LossConfig,
                comm: Collectives, sequence_parallel: bool,
                c_main_grad: Optional[Callable[[], torch.Tensor]] = None):
        ctx.set_materialize_grads(False)
        e_all = comm.gather_rows(e) if sequence_parallel else e
        de = dc = db = None
        if cfg.one_pass:
            lse, zt, zsum, de, dc, db, prepared = one_pass(e_all, c, bias, targets, start, prepare, watch, cfg,
                                                           comm, main_grad=c_main_grad is not None or cfg.fp32_grads)
            if de is not None:
                de = _finish_de(de, comm, sequence_parallel)
        else:
            prepared = prepare()
            _BadTargets(prepared[2], comm, watch).send_now(comm)  # before the GEMMs (see _BadTargets)
            m, se, zt, zsum = _combine(*local_stats(e_all, c, bias, prepared[0], cfg), comm)
            lse = m + torch.log(se)
        targets, keep, counts, grad_scale = prepared
        loss = torch.where(keep, token_loss(lse, zt, zsum, cfg), 0.0)
        ctx.cfg, ctx.comm, ctx.sp, ctx.c_main_grad = cfg, comm, sequence_parallel, c_main_grad
        ctx.save_for_backward(e_all, c, bias, targets, keep, counts, grad_scale, lse, de, dc, db)
        ctx.mark_non_differentiable(counts)
        return loss, torch.where(keep, lse, 0.0), counts

    @staticmethod
    def backward(ctx, g_loss, g_lse, _g_counts):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "cce_parallel: double backward (create_graph=True, or differentiating a gradient of the loss) is "
                "not supported; the loss's gradients come from kernels that autograd cannot differentiate"
            )
        from cce_parallel import kernels

        e_all, c, bias, targets, keep, counts, grad_scale, lse, de1, dc1, db1 = ctx.saved_tensors
        cfg, comm, sp = ctx.cfg, ctx.comm, ctx.sp
        n = keep.shape[0]
        e_dtype = c.dtype  # e and c share the dtype (checked in ops/functional.py)
        if g_lse is not None and not torch.count_nonzero(g_lse):
            g_lse = None  # lse was returned but nothing used it
        g = g_loss.float() if g_loss is not None else lse.new_zeros(1).expand(n)
        stored = cfg.one_pass and g_lse is None  # the forward's gradients serve, scaled
        if stored:
            # The one-pass gradients may be scaled in place and handed out as they are, so a
            # second backward through this loss (retain_graph) would read them changed: refused.
            if getattr(ctx, "gave_gradients", False):
                raise RuntimeError(
                    "cce_parallel: a second backward through the same loss (retain_graph=True) is not "
                    "supported when the gradients are computed in the forward; use logits_budget='lean' for that"
                )
            ctx.gave_gradients = True
            # dC and dE made in the input dtype are rounded already: scaled exactly only by a power
            # of two, recomputed otherwise (see below).
            rounded_de = de1 is not None and de1.dtype != torch.float32
            low = rounded_de or (dc1 is not None and dc1.dtype != torch.float32)
            main = ctx.c_main_grad() if dc1 is not None and ctx.c_main_grad is not None else None
            f32 = dict(device=lse.device, dtype=torch.float32)
            de = w = None
            if g.numel() and g.stride(0) == 0:  # one number expanded (reduction mean or sum)
                kind = "one"
                g_k = g
                # Nothing kept gives zeros, even where "mean" made the upstream gradient infinite.
                ratio = torch.where(counts[0] > 0, g[0] / grad_scale, 0.0)
            else:
                # Ignored tokens' upstream gradients may be anything: they count as 0.
                g_k = torch.where(keep, g, 0.0)
                w = g_k / grad_scale
                if cfg.fp32_grads or per_token_weights_seen:  # learned from earlier calls: sort on the host
                    kind, r = _weights_kind(w, keep)  # the one host sync
                    ratio = torch.full((), r, **f32) if r is not None else None
                else:  # the device decides, no host sync (see _weights_over_kept)
                    kind = "device"
                    ratio, weighted = _weights_over_kept(w, keep)
                if de1 is not None and not rounded_de:
                    # dE is linear in each token's weight: its fp32 rows scale exactly, whatever w is.
                    de = kernels.scaled_copy(de1, w[comm.rank * de1.shape[0]: (comm.rank + 1) * de1.shape[0]]
                                             if sp else w, e_dtype)
            if kind in ("one", "device"):
                report = None
                if low or kind == "device":
                    # A bf16 dC or dE, rounded in the forward, is exactly scaled only by a power of two;
                    # for anything else, and for per-token weights that are not one number, the flag
                    # makes kernels.weighted_grads recompute them (on the device), and the report tells
                    # the host (read_backward_reports).
                    ratio, flag, report = kernels.snap_ratio(ratio, weighted if kind == "device" else None, snap=low)
                if de is None:
                    de = _scaled(de1, ratio, e_dtype)
                db = _scaled(db1, ratio, bias.dtype) if db1 is not None else None
                if main is not None:
                    main.addcmul_(dc1, ratio)
                dc = _scaled(dc1, ratio, c.dtype) if main is None else None
                if report is not None:
                    a, b, u = coefficients(g_k if kind == "device" else torch.where(keep, g, 0.0), None, lse, cfg)
                    scale = kernels.grad_scale(a, b, u) if e_dtype == torch.float16 else a.new_ones(1)
                    kernels.weighted_grads(flag, e_all, c, bias, targets, lse, a, b, u, scale,
                                           main if main is not None else dc, db, de if rounded_de else None,
                                           softcap=cfg.softcap, add_dc=main is not None)
                    _report(report, cfg.loss_scale)
            elif kind == "mask" and not low:
                # Weights r on most kept tokens, 0 on the m masked ones: dC = r (dC1 - the masked rows'
                # part), the correction recomputed by the lean backward on those m rows alone and added
                # to the fp32 dC1 (dbias likewise), then rounded once. Each rank corrects its own shard
                # (lse is global, targets outside it are -1): no collective.
                dc = db = None
                for t in (dc1, db1):
                    if t is not None:
                        kernels.scale_(t, ratio)
                if dc1 is not None or db1 is not None:
                    rows = torch.nonzero(keep & (w == 0)).squeeze(1)
                    g_m = (ratio * grad_scale).neg().expand(rows.numel()).contiguous()
                    a, b, u = coefficients(g_m, None, lse[rows], cfg)
                    _, _, db2 = lean_backward(e_all[rows], c, bias, targets[rows], lse[rows], a, b, u, cfg,
                                              need_de=False, dc_out=dc1)
                    db = db1.add_(db2).to(bias.dtype) if db1 is not None else None
                    dc = _fp32_dc(dc1, main, c.dtype) if dc1 is not None else None
            else:
                # Any other weights (or a mask where the forward, made before the host learned of
                # masks, rounded dC or dE to bf16: scaling those would round them twice): the lean
                # backward recomputes dC, dbias and a rounded dE, exact for any weights, and later
                # calls avoid this (see the process-wide state).
                if kind == "many":
                    _warn_many()
                else:
                    _saw_masked()
                a, b, u = coefficients(g_k, None, lse, cfg)
                dc = db = None
                if dc1 is not None or db1 is not None or rounded_de:
                    fp32_dc = dc1 is not None and dc1.dtype == torch.float32
                    de2, dc, db = lean_backward(e_all, c, bias, targets, lse, a, b, u, cfg, need_de=rounded_de,
                                                dc_out=dc1.zero_() if fp32_dc else None)
                    db = db.to(bias.dtype) if db1 is not None else None
                    dc = _fp32_dc(dc, main, c.dtype) if fp32_dc else dc if dc1 is not None else None
                    if rounded_de:
                        de = _finish_de(de2, comm, sp).to(e_dtype)
        else:
            # Ignored tokens' upstream gradients may be anything: they count as 0.
            g_k = torch.where(keep, g, 0.0)
            h_k = None if g_lse is None else torch.where(keep, g_lse.float(), 0.0)
            a, b, u = coefficients(g_k, h_k, lse, cfg)
            de, dc, db = lean_backward(e_all, c, bias, targets, lse, a, b, u, cfg, need_de=cfg.need_de)
            if de is not None:
                de = _finish_de(de, comm, sp).to(e_dtype)
            if dc is not None and ctx.c_main_grad is not None:
                ctx.c_main_grad().add_(dc)
                dc = None
            db = db.to(bias.dtype) if db is not None and cfg.need_db else None
        if not cfg.need_dc or ctx.c_main_grad is not None:
            dc = None  # with c_main_grad, dC went into that buffer; c's .grad is left alone
        return de if cfg.need_de else None, dc, db, None, None, None, None, None, None, None, None


def _finish_de(de, comm, sequence_parallel):
    """fp32 partial dE over this rank's vocabulary -> the full sum over ranks, or under sequence
    parallelism this rank's rows of it."""
    return comm.sum_scatter_rows(de) if sequence_parallel else comm.all_sum_(de)


def _fp32_dc(dc, main, dtype):
    """An fp32 dC -> added to main (then None), or rounded once to dtype."""
    if main is not None:
        main.add_(dc)
        return None
    return dc.to(dtype)
