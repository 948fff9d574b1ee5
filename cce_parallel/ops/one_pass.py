"""The one-pass path: the loss and its gradients in one sweep of three logit-sized GEMMs.

Tokens go in blocks whose logits over the whole local vocabulary fit `logits_budget` (in the input
dtype). Per block: the fused GEMM (kernels/probs_gemm.py) writes W = exp(z - ref) of X = E_b C^T
and per-row sums; those (and, under tensor parallelism, their all-reduce) give lse and the loss;
per-row scalars (one Triton pass, kernels.grad_rows) make W the logit gradient G, for g =
grad_scale on every kept token (0 on ignored ones); then dE_b = G C and dC += G^T E_b. That is
three logit-sized GEMMs in all, the fewest an exact method needs. The backward (ops/autograd.py)
only scales these by the upstream gradient over grad_scale, or corrects them (ops/upstream.py).

Accumulation: dE is summed in fp32 over the vocabulary (and over tensor-parallel ranks) and
rounded once: in the forward where dC is bf16 and no other rank adds to it (no fp32 dE is kept
then: on a one-block head that is the difference between torch.compile's peak and 48 MiB above
it, Phi 3.5 mini), else in the backward. dC is summed over the token blocks in the input dtype by
the dC GEMMs themselves, except for the batch's target rows, which are summed in fp32 outside dC
and rounded into it once with their target term (kernels/target_rows.py): summing those in bf16
too measured worse than plain bf16 PyTorch (docs/accuracy.md). Into Megatron's main_grad dC is
summed in fp32 and added at backward; so it is for the two-pass variant and label smoothing.
Nothing is filtered: on realistic data block sparsity is too low for skipping to pay
(docs/internals.md, "Gradient filtering"). Ignored tokens go through the kernels with zero weight
rather than being removed first: removing them needs their count on the host, a sync that leaves
the GPU idle while the host prepares the launches. Everything is deterministic: library GEMMs and
kernels without atomics.
"""

import math

import torch

from cce_parallel.ops.common import (
    SINGLE,
    LossConfig,
    _BadTargets,
    _combine,
    _mm_into,
    _padded,
    coefficients,
    entropy_coefficients,
    fused_one_pass,
    logits_into,
    token_block,
)


def one_pass(e, c, bias, targets, weights, start, prepare, watch, cfg: LossConfig, comm, *, main_grad: bool = False,
             dc_into=None, mean_z=None, ent_weights=None):
    """(lse, zt, zsum, dE, dC, dbias, prepared) with the gradients of sum_t g[t] * loss[t]: dE the
    fp32 partial sum over this rank's vocabulary (in e's dtype, rounded once, where dC is and the
    call has one rank: de_dtype below), dbias fp32, dC in c's dtype (fp32 where it goes into an
    fp32 `main_grad`, and on the paths dc_dtype below names); None where not needed. See the
    module docstring. dc_into: an fp32 [V, D] tensor that dC is added into rather than a new one
    (with main_grad; a mask's correction, ops/autograd.py). mean_z: with cfg.entropy, an fp32 [n]
    tensor that gets each token's sum over the vocabulary of p z (its entropy is lse - that).
    ent_weights: None, or fp32 [n] weights of the tokens' entropies in the objective (cfg.entropy;
    0 at ignored tokens): the gradients are then those of sum_t g[t] * loss[t] + h[t] *
    entropy[t], h = keep * grad_scale * ent_weights.

    targets: the caller's (flat, contiguous), rows of c being vocabulary rows start ...
    prepare(): the targets' pass, prepared = (each token's row of c or -1, keep, counts,
    grad_scale) as LinearCrossEntropyFunction takes them; g = keep * grad_scale * weights (weights:
    None or fp32 [n]; 0 at ignored tokens, whose gradients are thus 0). It is called once the first block's fused GEMM is queued:
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
    if cfg.entropy and mean_z is None:
        mean_z = torch.empty(n, **f32)
    # With the entropy in the objective W's entries are rewritten (kernels.grad_rows), the softcap's
    # factor with them: the GEMM leaves it out.
    probs = dict(softcap=cfg.softcap, need_zsum=uniform, config=cfg.kernel, temperature=cfg.temperature,
                 need_pz=cfg.entropy, cap_in_w=ent_weights is None)
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
        first_stats = kernels.logits_probs(e[:k], c, bias, targets[:k], start, buf[:k, :v], zt[:k], **probs)
    prepared = prepare()
    bad = _BadTargets(prepared[2], comm, watch)  # sent with the first block's statistics
    raw, targets = targets, prepared[0]
    g_rows = torch.mul(prepared[1], prepared[3])
    ent_rows = g_rows * ent_weights if ent_weights is not None else None  # h, as g_rows is g
    if weights is not None:  # per-token weights: the weighted loss's gradients, in the same pass
        g_rows = g_rows * weights
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
    dc = alloc((v, d), device=c.device, dtype=dc_dtype) if cfg.need_dc and dc_into is None else dc_into
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
    elif e.dtype == torch.float16:  # from the weights (no block's lse is known yet); |p (z - E[z])| < log V
        scale = kernels.grad_scale(g_rows, g_rows,
                                   ent_rows * math.log(max(cfg.vocab_size, 2)) if ent_rows is not None else None)
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
                ref, s, zs, pz = first_stats
            else:
                ref, s, zs, pz = kernels.logits_probs(e_b, c, bias, raw[rows], start, x, zt[rows], **probs)
            m = ref
            if comm.world > 1:  # the ranks' statistics: one MAX and one SUM all-reduce
                m, s, zt[rows], zs, pz = _combine(ref, s, zt[rows], zs, comm, bad=bad, pz=pz)
            if zsum is not None:
                zsum[rows] = zs
            if mean_z is not None:
                mean_z[rows] = pz / s
            k = rows.stop - t0
            _fused_products(
                x, ref, m, s, e_b, c, t_b, g_rows[rows], cfg, lse[rows], zt[rows], w_rows[:k],
                b_all[rows] if b_all is not None else b_rows[:k], de[rows] if de is not None else None, dc, db,
                csum, u_rows, first=t0 == 0 and dc_into is None, dc_target=b_all is None,
                de_tmp=de_tmp[:k] if de_tmp is not None else None,
                h_rows=ent_rows[rows] if ent_rows is not None else None,
                mean_z=mean_z[rows] if mean_z is not None else None,
            )
            continue
        logits_into(x, e_b, c)
        m, se, zt[rows], zs, pz = _stats_of_block(x, bias, t_b, cfg, comm, bad)
        if mean_z is not None:
            mean_z[rows] = pz / se
        lse[rows] = m + torch.log(se)
        if zsum is not None:
            zsum[rows] = zs
        _two_pass_products(x, e_b, c, bias, t_b, g_rows[rows], scale, cfg, lse[rows],
                           de[rows] if de is not None else None, dc, db, first=t0 == 0 and dc_into is None,
                           h_rows=ent_rows[rows] if ent_rows is not None else None,
                           mean_z=mean_z[rows] if ent_rows is not None else None)
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
                    *, first, dc_target, de_tmp=None, h_rows=None, mean_z=None):
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
    if cfg.temperature != 1.0:  # d z / d x = 1 / temperature (before the softcap's factor)
        g_rows = g_rows * (1.0 / cfg.temperature)
        h_rows = h_rows * (1.0 / cfg.temperature) if h_rows is not None else None
    # Products in fp32, each rounded once. dC goes first, so that w E can sit in the memory of dE's
    # rows, which the GEMM below then writes.
    we = None
    if dc is not None:
        we = torch.empty_like(e) if de_rows is None else de_rows.view(-1).view(e.dtype)[: e.numel()].view_as(e)
    kernels.grad_rows(w_mat, ref, m, s, zt, g_rows, targets, lse, w, b, e if we is not None else None, we,
                      softcap=cfg.softcap, z_loss=cfg.z_loss, label_smoothing=cfg.label_smoothing,
                      h=h_rows.contiguous() if h_rows is not None else None, mean_z=mean_z)
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


def _two_pass_products(x, e, c, bias, targets, g_rows, scale, cfg, lse, de_rows, dc, db, *, first, h_rows=None,
                       mean_z=None):
    """dE rows, dC and dbias of one block whose lse is known, times `scale` (fp32 [1]): the logit
    gradient in place, then GEMMs. h_rows, mean_z: the entropies' weights and E[z], or None."""
    from cce_parallel import kernels

    a, b, u = coefficients(g_rows, None, lse, cfg)
    k = None
    if h_rows is not None:
        a, k = entropy_coefficients(a, h_rows, mean_z, cfg)
    g = kernels.dz_rows_in_place(
        x, bias, targets, lse, a, b, u, scale, e.dtype, softcap=cfg.softcap, config=cfg.kernel,
        temperature=cfg.temperature, coef_h=k,
    )
    if de_rows is not None:
        _mm_into(de_rows, g, c, accumulate=False)
    if dc is not None:
        _mm_into(dc, g.t(), e, accumulate=not first)
    if db is not None:
        db.add_(g.sum(dim=0, dtype=torch.float32))


def _fp32_out(t):
    return {} if t.dtype == torch.float32 else {"out_dtype": torch.float32}


def _stats_of_block(x, bias, targets, cfg, comm, bad=None):
    """Global (max, sumexp, zt, zsum, pz) of the tokens whose fp32 logits over the whole local
    vocabulary are x [k, V]: one statistics pass, then the ranks' all-reduces (_combine's `bad`)."""
    from cce_parallel import kernels

    k, v = x.shape
    need_zsum = cfg.label_smoothing > 0
    slices = kernels.stats_slices(k, v, cfg.kernel, x.is_cuda)
    f32 = dict(device=x.device, dtype=torch.float32)
    mx = torch.empty((slices, k), **f32)
    se, zt = torch.empty((slices, k), **f32), torch.empty((slices, k), **f32)
    zsum = torch.empty((slices, k), **f32) if need_zsum else None
    pz = torch.empty((slices, k), **f32) if cfg.entropy else None
    kernels.stats_from_logits(
        x, bias, targets, cfg.softcap, mx, se, zt, zsum, split=0, slices=slices, v_lo=0, v_hi=v, config=cfg.kernel,
        temperature=cfg.temperature, pz=pz,
    )
    m, se, zt, zsum, pz = _combine(mx, se, zt, zsum, SINGLE, dim=0, pz=pz)
    return _combine(m, se, zt, zsum, comm, bad=bad, pz=pz)
