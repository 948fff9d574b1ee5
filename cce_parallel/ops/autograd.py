"""The CCE autograd.Function: the forward takes the one-pass path (ops/one_pass.py) whenever a
gradient is needed and the budget allows, else the lean path (ops/lean.py); the backward hands out
the one-pass gradients scaled or corrected for the upstream gradient (ops/upstream.py), or
recomputes them on the lean path. The math and the shared pieces: ops/common.py.

Per-token weights given in the forward multiply each kept token's loss, and entropy weights add
that many times its entropy; the one-pass gradients are made for them, so that an upstream
gradient that is one number (the weighted losses' mean or sum) only scales them. In every
recompute the upstream gradient is multiplied by them.
"""

import dataclasses
import math
from collections import Counter
from typing import Callable, Optional

import torch

from cce_parallel.ops import upstream
from cce_parallel.ops.upstream import UpstreamState
from cce_parallel.ops.common import (
    Collectives,
    LossConfig,
    _BadTargets,
    _combine,
    coefficients,
    entropy_coefficients,
    token_loss,
)
from cce_parallel.ops.lean import lean_backward, local_stats
from cce_parallel.ops.one_pass import one_pass


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
    """Per-token loss (times weights, if given) and log-sum-exp, fp32, for all n tokens (0 at
    ignored ones), the targets' counts (int64 [2], the first the number of kept tokens), and with
    cfg.entropy each token's entropy (fp32 [n], 0 at ignored ones; else an empty tensor).

    e: [n_rows, D] (this rank's rows under sequence parallelism, else all n); c: [V_shard, D], rows
    start .. start + V_shard of the vocabulary; bias: [V_shard] or None; targets: [n], the
    caller's, flat and contiguous; weights: None or fp32 [n], each token's weight (0 at ignored
    tokens; it may need a gradient: the token's unweighted loss); ent_weights: None or fp32 [n]
    (0 at ignored tokens; cfg.entropy): each token's loss is then weights * loss + ent_weights *
    entropy (its gradient: the entropy); prepare(): the targets' pass (ops/functional.py), returning
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
    Function. state: the caller's UpstreamState (ops/upstream.py), which reads the backward's
    report and records the paths taken; None: nothing is learned or recorded.
    """

    @staticmethod
    def forward(ctx, e, c, bias, targets, weights, ent_weights, start: int, prepare: Callable, watch: Callable, cfg: LossConfig,
                comm: Collectives, sequence_parallel: bool,
                c_main_grad: Optional[Callable[[], torch.Tensor]] = None, state: Optional[UpstreamState] = None):
        ctx.set_materialize_grads(False)
        e_all = comm.gather_rows(e) if sequence_parallel else e
        de = dc = db = mean_z = None
        if state is not None:
            state.paths["one_pass" if cfg.one_pass else "lean"] += 1
        if cfg.one_pass:
            # defer_dc: dE alone, in fp32 (it scales per row, exactly); dC and dbias in the backward.
            fwd_cfg = dataclasses.replace(cfg, need_dc=False, need_db=False) if cfg.defer_dc else cfg
            mean_z = torch.empty(e_all.shape[0], device=e.device, dtype=torch.float32) if cfg.entropy else None
            lse, zt, zsum, de, dc, db, prepared = one_pass(
                e_all, c, bias, targets, weights, start, prepare, watch, fwd_cfg, comm,
                main_grad=c_main_grad is not None or cfg.fp32_grads or cfg.defer_dc, mean_z=mean_z,
                ent_weights=ent_weights)
            if de is not None:
                de = _finish_de(de, comm, sequence_parallel)
        else:
            prepared = prepare()
            _BadTargets(prepared[2], comm, watch).send_now(comm)  # before the GEMMs (see _BadTargets)
            mx, se, zt, zsum, pz = local_stats(e_all, c, bias, prepared[0], cfg)
            m, se, zt, zsum, pz = _combine(mx, se, zt, zsum, comm, pz=pz)
            lse = m + torch.log(se)
            mean_z = pz / se if pz is not None else None
        targets, keep, counts, grad_scale = prepared
        loss = torch.where(keep, token_loss(lse, zt, zsum, cfg), 0.0)
        unweighted = None
        if weights is not None:
            unweighted = loss if ctx.needs_input_grad[4] else None  # d (w * loss) / d w
            loss = loss * weights
        entropy = torch.where(keep, lse - mean_z, 0.0) if cfg.entropy else lse.new_empty(0)
        if ent_weights is not None:
            loss = loss + ent_weights * entropy
        ctx.cfg, ctx.comm, ctx.sp, ctx.c_main_grad, ctx.state = cfg, comm, sequence_parallel, c_main_grad, state
        ctx.save_for_backward(e_all, c, bias, targets, weights, unweighted, keep, counts, grad_scale, lse, de, dc,
                              db, mean_z, ent_weights, entropy if ctx.needs_input_grad[5] else None)
        ctx.mark_non_differentiable(counts)
        return loss, torch.where(keep, lse, 0.0), counts, entropy

    @staticmethod
    def backward(ctx, g_loss, g_lse, _g_counts, g_entropy):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "cce_parallel: double backward (create_graph=True, or differentiating a gradient of the loss) is "
                "not supported; the loss's gradients come from kernels that autograd cannot differentiate"
            )
        from cce_parallel import kernels

        (e_all, c, bias, targets, weights, unweighted, keep, counts, grad_scale, lse, de1, dc1,
         db1, mean_z, ent_weights, entropy) = ctx.saved_tensors
        cfg, comm, sp, state = ctx.cfg, ctx.comm, ctx.sp, ctx.state
        paths = state.paths if state is not None else Counter()

        def of_unweighted(g_k):  # an upstream gradient of the weighted loss -> of the unweighted one
            return g_k if weights is None else g_k * weights

        def of_entropy(g_k):  # -> of the entropy, through the entropy weights (None without)
            return None if ent_weights is None else g_k * ent_weights

        def coefs(g_k, h_k=None, k_ent=None):
            """(A, B, U, H) for upstream g_k of the loss, h_k of lse, k_ent of the entropy."""
            a, b, u = coefficients(of_unweighted(g_k), h_k, lse, cfg)
            k = of_entropy(g_k)
            if k_ent is not None:
                k = k_ent if k is None else k + k_ent
            if k is not None:  # the entropy's part, -k p (z - E[z])
                a, k = entropy_coefficients(a, k, mean_z, cfg)
            return a, b, u, k

        def take_out(rows, valid=None):
            """A mask's correction: the one-pass part of the given rows (kept ones where `valid`)
            taken out of the forward's fp32 dC, in one more sweep of those rows alone; returns
            their fp32 dbias part (negated), or None. The rows are the same on every rank (they all
            get the same upstream gradient), so under tensor parallelism their statistics are
            all-reduced alike."""
            g_m = grad_scale.neg().expand(rows.numel())  # the forward's weights of those rows, negated
            h_m = (g_m * ent_weights[rows]).contiguous() if ent_weights is not None else None
            g_m = (g_m * weights[rows] if weights is not None else g_m).contiguous()
            kept = keep[rows] if valid is None else keep[rows] & valid
            prepared = (targets[rows], kept, counts, torch.ones_like(grad_scale))
            return one_pass(e_all[rows], c, bias, targets[rows], g_m, 0, lambda: prepared, lambda bad: None,
                            _sweep_cfg(cfg, ent_weights), comm, main_grad=True, dc_into=dc1, ent_weights=h_m)[5]

        n = keep.shape[0]
        e_dtype = c.dtype  # e and c share the dtype (checked in ops/functional.py)
        if g_lse is not None and not torch.count_nonzero(g_lse):
            g_lse = None  # lse was returned but nothing used it
        if g_entropy is not None and (mean_z is None or not torch.count_nonzero(g_entropy)):
            g_entropy = None  # likewise the entropy (the forward's gradients leave it out)
        g = g_loss.float() if g_loss is not None else lse.new_zeros(1).expand(n)
        dw = torch.where(keep, g, 0.0) * unweighted if unweighted is not None else None
        d_ent_w = torch.where(keep, g, 0.0) * entropy if entropy is not None else None
        stored = cfg.one_pass and g_lse is None and g_entropy is None  # the forward's gradients serve, scaled
        if stored and cfg.defer_dc:
            # The state knew that this loss's weights come in the backward only: dE (fp32, made in
            # the forward) scales per row exactly; dC and dbias take one more pass for the weights
            # (the fused GEMM again, then dC's GEMM): four logit-sized GEMMs in all, the least any
            # weights unknown in the forward allow, and no host sync.
            paths["deferred"] += 1
            g_k = torch.where(keep, g, 0.0)
            de = None
            if de1 is not None:
                w = g_k / grad_scale
                de = kernels.scaled_copy(de1, w[comm.rank * de1.shape[0]: (comm.rank + 1) * de1.shape[0]]
                                         if sp else w, e_dtype)
            dc = db = None
            if cfg.need_dc or cfg.need_db:
                main = ctx.c_main_grad() if cfg.need_dc and ctx.c_main_grad is not None else None
                prepared = (targets, keep, counts, torch.ones_like(grad_scale))
                _, _, _, _, dc, db, _ = one_pass(e_all, c, bias, targets, of_unweighted(g_k), 0, lambda: prepared,
                                                 lambda bad: None, _sweep_cfg(cfg, ent_weights), comm,
                                                 main_grad=main is not None, ent_weights=of_entropy(g_k))
                if main is not None:
                    dc = _fp32_dc(dc, main, c.dtype)
                db = db.to(bias.dtype) if db is not None else None
        elif stored:
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
                if cfg.fp32_grads:  # the state knew of masks (masked_weights_seen): sort on the host
                    kind_of = upstream._weights_kind(w, keep)
                else:  # the device decides, no host sync (see _weights_over_kept)
                    kind = "device"
                    ratio, weighted = upstream._weights_over_kept(w, keep)
                if de1 is not None and not rounded_de:
                    # dE is linear in each token's weight: its fp32 rows scale exactly, whatever w is.
                    de = kernels.scaled_copy(de1, w[comm.rank * de1.shape[0]: (comm.rank + 1) * de1.shape[0]]
                                             if sp else w, e_dtype)
                if cfg.fp32_grads:
                    # Before the one host sync (which waits for the forward), the correction of as many
                    # masked rows as the last mask had (ops/upstream.py): the GPU runs it while the host
                    # learns the weights' kind and queues the rest. Where they are no mask after all,
                    # it has taken out nothing (no weight 0) or dC is recomputed (below).
                    sweep = state is not None and (dc1 is not None or db1 is not None)
                    ahead = min(state.masked_rows, n) if sweep else 0
                    if ahead:
                        rows = torch.nonzero_static(keep & (w == 0), size=ahead, fill_value=-1).squeeze(1)
                        db_ahead = take_out(rows.clamp(min=0), rows >= 0)
                    kind, r, masked = kind_of()  # the one host sync
                    ratio = torch.full((), r, **f32) if r is not None else None
            if kind in ("one", "device"):
                paths["checked" if kind == "device" else "scaled"] += 1
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
                    a, b, u, k = coefs(g_k if kind == "device" else torch.where(keep, g, 0.0))
                    scale = a.new_ones(1)
                    if e_dtype == torch.float16:  # |p (z - E[z])| < log V
                        bound = k.abs() * math.log(max(cfg.vocab_size, 2)) if k is not None else None
                        scale = kernels.grad_scale(a, b, u if bound is None else bound if u is None else u.abs() + bound)
                    kernels.weighted_grads(flag, e_all, c, bias, targets, lse, a, b, u, scale,
                                           main if main is not None else dc, db, de if rounded_de else None,
                                           softcap=cfg.softcap, add_dc=main is not None, temperature=cfg.temperature,
                                           h=k)
                    if state is not None:
                        state.report(report, cfg.loss_scale, cfg.loss_scale_given)
            elif kind == "mask" and not low:
                # Weights r on most kept tokens, 0 on the m masked ones: dC = r (dC1 - the masked rows'
                # part), that part made by one more pass on those m rows alone (take_out: the fused
                # GEMM, then dC's GEMM into the fp32 dC1; dbias likewise), then scaled by r and
                # rounded once, in one pass.
                paths["mask_corrected"] += 1
                if state is not None:
                    state.masked_rows = masked
                dc = db = None
                if dc1 is not None or db1 is not None:
                    db2 = db_ahead if ahead else None
                    if masked > ahead:  # the rows past those taken out before the sync
                        rows = torch.nonzero_static(keep & (w == 0), size=masked)[ahead:].squeeze(1)
                        rest = take_out(rows)
                        db2 = rest if db2 is None or rest is None else db2.add_(rest)
                    if db1 is not None:
                        db = db1.add_(db2).mul_(ratio).to(bias.dtype)
                    if dc1 is not None and main is not None:
                        main.addcmul_(dc1, ratio)
                    elif dc1 is not None:
                        dc = kernels.scaled_copy(dc1, ratio.reshape(1), c.dtype)
            else:
                # Any other weights (or a mask where the forward, made before the host learned of
                # masks, rounded dC or dE to bf16: scaling those would round them twice): the lean
                # backward recomputes dC, dbias and a rounded dE, exact for any weights, and later
                # calls of a loss that owns a state avoid this (ops/upstream.py).
                paths["recomputed"] += 1
                if state is not None:
                    state.saw_many() if kind == "many" else state.saw_mask()
                a, b, u, k = coefs(g_k)
                dc = db = None
                if dc1 is not None or db1 is not None or rounded_de:
                    fp32_dc = dc1 is not None and dc1.dtype == torch.float32
                    de2, dc, db = lean_backward(e_all, c, bias, targets, lse, a, b, u, cfg, need_de=rounded_de,
                                                dc_out=dc1.zero_() if fp32_dc else None, h=k)
                    db = db.to(bias.dtype) if db1 is not None else None
                    dc = _fp32_dc(dc, main, c.dtype) if fp32_dc else dc if dc1 is not None else None
                    if rounded_de:
                        de = _finish_de(de2, comm, sp).to(e_dtype)
        else:
            # Ignored tokens' upstream gradients may be anything: they count as 0.
            g_k = torch.where(keep, g, 0.0)
            h_k = None if g_lse is None else torch.where(keep, g_lse.float(), 0.0)
            paths["lean"] += 1
            a, b, u, k = coefs(g_k, h_k, None if g_entropy is None else torch.where(keep, g_entropy.float(), 0.0))
            de, dc, db = lean_backward(e_all, c, bias, targets, lse, a, b, u, cfg, need_de=cfg.need_de, h=k)
            if de is not None:
                de = _finish_de(de, comm, sp).to(e_dtype)
            if dc is not None and ctx.c_main_grad is not None:
                ctx.c_main_grad().add_(dc)
                dc = None
            db = db.to(bias.dtype) if db is not None and cfg.need_db else None
        if not cfg.need_dc or ctx.c_main_grad is not None:
            dc = None  # with c_main_grad, dC went into that buffer; c's .grad is left alone
        return de if cfg.need_de else None, dc, db, None, dw, d_ent_w, None, None, None, None, None, None, None, None


def _sweep_cfg(cfg: LossConfig, ent_weights) -> LossConfig:
    """A backward's extra one-pass sweep (dC deferred, a mask's correction): dC and dbias alone,
    with the entropy's statistics only where entropy weights put it in the objective."""
    return dataclasses.replace(cfg, need_de=False, entropy=ent_weights is not None)


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
