"""dC, dbias and (where the forward rounded it to bf16) dE recomputed for per-token weights, or
for an upstream number that is not a power of two away from the one they were made for; or
nothing at all, as a flag on the device says.

The one-pass path computes the gradients in the forward for one weight per kept token. When the
backward gets a per-token upstream gradient, whether it is that one number (Megatron's loss_mask /
count with the mask folded into ignore_index) or real per-token weights is known only on the
device; so is whether a bf16 dC or dE, scaled exactly only by a power of two, needs recomputing.
Asking the host would leave the GPU idle until it queues the next work (11 % of Phi 3.5 mini's
loss + gradients on an H100). So this one launch always goes into the queue, and each of its
programs reads the flag first: 0, and it returns (a few microseconds); otherwise it computes

    dC[v] = sum_t dz[t, v] E[t],  dbias[v] = sum_t dz[t, v],  dE[t] = sum_v dz[t, v] C[v],
    dz = A p - B [v == target] - U

(times the softcap's 1 - tanh^2), p = exp(z - lse), dz rounded to the input dtype once as in the
lean backward, the sums in fp32. A looping grid of a few programs per SM (so a flag of 0 costs
one short launch) walks two kinds of tiles: each [BLOCK_V, BLOCK_D] tile of dC belongs to one
program, which walks all tokens, recomputing their [BLOCK_N, BLOCK_V] logits over the whole D
(blocks of tokens whose A, B and U are all 0 are skipped); each [BLOCK_N, BLOCK_D] tile of dE
likewise walks the whole vocabulary. That repeats the logits GEMM cdiv(D, BLOCK_D) times per
gradient, but needs no workspace, no atomics (deterministic) and no second launch; it runs only
for a process's first per-token-weighted calls (the host then learns of them, ops/upstream.py) and
the first calls at a loss scale the host has not learned yet. Offsets are int64.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from cce_parallel.kernels.tiles import activate, logit_grad, probs_tile


@triton.jit
def _dz_tile(offs_n, mask_n, rows, mask_v, E_ptr, C_ptr, Bias_ptr, Tgt_ptr, Lse_ptr, A_ptr, B_ptr, U_ptr, H_ptr, scale,
             softcap, inv_temp, D, stride_en, stride_cv, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
             HAS_UNIFORM: tl.constexpr, HAS_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_V] logit gradient of tokens offs_n and classifier rows `rows`, times
    scale, rounded to the input dtype (0 outside the masks): the logits recomputed over all of D."""
    x = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        mask_k = ks < D
        e = tl.load(E_ptr + offs_n[:, None] * stride_en + ks[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        c = tl.load(C_ptr + rows[:, None] * stride_cv + ks[None, :],
                    mask=mask_v[:, None] & mask_k[None, :], other=0.0)
        x = tl.dot(e, tl.trans(c), x, input_precision=PRECISION)
    m = mask_n[:, None] & mask_v[None, :]
    z, t = activate(x, Bias_ptr, rows, mask_v, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
    p, is_t = probs_tile(z, Lse_ptr, Tgt_ptr, offs_n, mask_n, rows, m)
    dz = logit_grad(p, is_t, t, z, offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM, HAS_SOFTCAP, HAS_ENTROPY)
    return tl.where(m, dz * scale, 0.0).to(E_ptr.dtype.element_ty)


@triton.jit
def _weighted_tokens(offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM: tl.constexpr, HAS_ENTROPY: tl.constexpr):
    """Whether any of the tokens offs_n has a nonzero (or NaN) coefficient: NaN must reach the result."""
    weight = tl.abs(tl.load(A_ptr + offs_n, mask=mask_n, other=0.0))
    weight += tl.abs(tl.load(B_ptr + offs_n, mask=mask_n, other=0.0))
    if HAS_UNIFORM:
        weight += tl.abs(tl.load(U_ptr + offs_n, mask=mask_n, other=0.0))
    if HAS_ENTROPY:
        weight += tl.abs(tl.load(H_ptr + offs_n, mask=mask_n, other=0.0))
    return tl.sum(weight, axis=0) != 0.0


@triton.jit
def _weighted_grads_kernel(
    Flag_ptr,  # [1] int32: 0 = return at once
    E_ptr,  # [N, D] row stride stride_en
    C_ptr,  # [V, D] row stride stride_cv
    Bias_ptr,  # [V] (dummy unless HAS_BIAS)
    Tgt_ptr,  # [N] int64 target row in this shard, outside [0, V) when not here
    Lse_ptr,  # [N] fp32
    A_ptr,  # [N] fp32 coefficient of p
    B_ptr,  # [N] fp32 coefficient of the one-hot target
    U_ptr,  # [N] fp32 uniform coefficient (dummy unless HAS_UNIFORM)
    H_ptr,  # [N] fp32 coefficient of p z, the entropy's (dummy unless HAS_ENTROPY)
    Scale_ptr,  # [1] fp32 power of two dz is stored times (fp16), divided out at the end
    DC_ptr,  # [V, D] out, row stride stride_dc: written, or added to where ADD_DC
    DB_ptr,  # [V] out: written (dummy unless NEED_DB)
    DE_ptr,  # [N, D] out, contiguous: written (dummy unless NEED_DE)
    softcap,
    inv_temp,
    N,
    V,
    D,
    stride_en,
    stride_cv,
    stride_dc,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    NEED_DC: tl.constexpr,
    NEED_DB: tl.constexpr,
    NEED_DE: tl.constexpr,
    ADD_DC: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.load(Flag_ptr) != 0:
        # A looping grid: with the flag 0, one program per tile were 33k early exits for Qwen 2.5
        # 7B's dC (0.08 ms of its masked backward on an H200); a few per SM take ~2 us (H100).
        scale = tl.load(Scale_ptr)
        tiles_v = tl.cdiv(V, BLOCK_V)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles_d = tl.cdiv(D, BLOCK_D)
        tiles_c = tiles_v * tiles_d if NEED_DC else (tiles_v if NEED_DB else 0)
        tiles = tiles_c + (tiles_n * tiles_d if NEED_DE else 0)
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            if tile < tiles_c:  # a tile of dC (and its rows of dbias): all tokens
                pid_v = (tile % tiles_v).to(tl.int64)
                pid_d = (tile // tiles_v).to(tl.int64)
                rows = pid_v * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
                mask_v = rows < V
                cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
                mask_d = cols < D
                acc = tl.zeros([BLOCK_V, BLOCK_D], tl.float32)
                db = tl.zeros([BLOCK_V], tl.float32)
                for t0 in range(0, N, BLOCK_N):
                    offs_n = t0 + tl.arange(0, BLOCK_N).to(tl.int64)
                    mask_n = offs_n < N
                    if _weighted_tokens(offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM, HAS_ENTROPY):
                        g = _dz_tile(offs_n, mask_n, rows, mask_v, E_ptr, C_ptr, Bias_ptr, Tgt_ptr, Lse_ptr, A_ptr,
                                     B_ptr, U_ptr, H_ptr, scale, softcap, inv_temp, D, stride_en, stride_cv, HAS_BIAS,
                                     HAS_SOFTCAP,
                                     HAS_UNIFORM, HAS_ENTROPY, PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
                        if NEED_DC:
                            e_d = tl.load(E_ptr + offs_n[:, None] * stride_en + cols[None, :],
                                          mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                            acc = tl.dot(tl.trans(g), e_d, acc, input_precision=PRECISION)
                        if NEED_DB:
                            db += tl.sum(g.to(tl.float32), axis=0)
                if NEED_DC:
                    out = DC_ptr + rows[:, None] * stride_dc + cols[None, :]
                    mask = mask_v[:, None] & mask_d[None, :]
                    acc = acc / scale
                    if ADD_DC:
                        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
                    tl.store(out, acc.to(DC_ptr.dtype.element_ty), mask=mask)
                if NEED_DB:  # noqa: SIM102 - a constexpr, then a runtime test
                    if pid_d == 0:
                        tl.store(DB_ptr + rows, (db / scale).to(DB_ptr.dtype.element_ty), mask=mask_v)
            else:  # a tile of dE: all of the vocabulary
                tile_e = tile - tiles_c
                pid_n = (tile_e % tiles_n).to(tl.int64)
                pid_d = (tile_e // tiles_n).to(tl.int64)
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
                mask_n = offs_n < N
                cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
                mask_d = cols < D
                acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
                if _weighted_tokens(offs_n, mask_n, A_ptr, B_ptr, U_ptr, H_ptr, HAS_UNIFORM, HAS_ENTROPY):
                    for v0 in range(0, V, BLOCK_V):
                        rows = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
                        mask_v = rows < V
                        g = _dz_tile(offs_n, mask_n, rows, mask_v, E_ptr, C_ptr, Bias_ptr, Tgt_ptr, Lse_ptr, A_ptr,
                                     B_ptr, U_ptr, H_ptr, scale, softcap, inv_temp, D, stride_en, stride_cv, HAS_BIAS,
                                     HAS_SOFTCAP,
                                     HAS_UNIFORM, HAS_ENTROPY, PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
                        c_d = tl.load(C_ptr + rows[:, None] * stride_cv + cols[None, :],
                                      mask=mask_v[:, None] & mask_d[None, :], other=0.0)
                        acc = tl.dot(g, c_d, acc, input_precision=PRECISION)
                acc = acc / scale
                tl.store(DE_ptr + offs_n[:, None] * D + cols[None, :], acc.to(DE_ptr.dtype.element_ty),
                         mask=mask_n[:, None] & mask_d[None, :])


# Tiles on a GPU (tuned nowhere: this kernel runs only for a process's first per-token-weighted
# calls and the first calls at a new loss scale); on the interpreter, small ones that still leave
# partial blocks at every edge of the tests.
CUDA_BLOCKS = {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_D": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}
CPU_BLOCKS = {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_D": 32, "BLOCK_K": 16, "num_warps": 1, "num_stages": 2}
# (device, dtype) -> the tiles that fit, where CUDA_BLOCKS needed more shared memory than the GPU
# has (fp32 inputs on GPUs with ~100 KB per SM). The launch is queued on every per-token backward
# and every backward of a bf16 dC or dE, so it must compile everywhere.
_FITTING: dict = {}


def _smaller(blocks: dict) -> dict:
    """Narrower dC / dE tiles down to 32 columns, then one stage; OutOfResources when there is none."""
    if blocks["BLOCK_D"] > 32:
        return dict(blocks, BLOCK_D=blocks["BLOCK_D"] // 2)
    if blocks["num_stages"] > 1:
        return dict(blocks, num_stages=1)
    raise OutOfResources(0, 0, "shared memory (no smaller tiling of weighted_grads)")


@functools.cache
def _programs(device: torch.device) -> int:
    # A few programs per SM on a GPU; on the interpreter fewer than the tests' tiles, so that each
    # program walks several.
    if device.type != "cuda":
        return 3
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _launch(blocks, flag, e, c, bias, targets, lse, a, b, u, h, scale, dc, db, de, softcap, temperature, add_dc):
    n, d = e.shape
    v = c.shape[0]
    # As the kernel counts them: dC tiles (or one column of them for dbias alone), then dE tiles.
    tiles_d = triton.cdiv(d, blocks["BLOCK_D"])
    tiles = 0
    if dc is not None or db is not None:
        tiles += triton.cdiv(v, blocks["BLOCK_V"]) * (tiles_d if dc is not None else 1)
    if de is not None:
        tiles += triton.cdiv(n, blocks["BLOCK_N"]) * tiles_d
    grid = (max(1, min(tiles, _programs(e.device))),)
    dummy = lse
    _weighted_grads_kernel[grid](
        flag, e, c, bias if bias is not None else dummy, targets, lse, a, b, u if u is not None else dummy,
        h if h is not None else dummy, scale,
        dc if dc is not None else dummy, db if db is not None else dummy, de if de is not None else dummy,
        float(softcap) if softcap is not None else 0.0, 1.0 / temperature, n, v, d, e.stride(0), c.stride(0),
        dc.stride(0) if dc is not None else 0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_UNIFORM=u is not None, HAS_ENTROPY=h is not None,
        NEED_DC=dc is not None, NEED_DB=db is not None, NEED_DE=de is not None, ADD_DC=add_dc,
        PRECISION="ieee", **blocks,  # fp32 inputs: full fp32 products (no effect on bf16 / fp16)
    )


def weighted_grads(flag, e, c, bias, targets, lse, a, b, u, scale, dc, db, de=None, *, softcap, add_dc: bool,
                   temperature=1.0, h=None):
    """If flag (int32 [1], on the device) is not 0: dC into dc (added to it where add_dc, else
    written), dbias written into db and dE written into de, of the logit gradient A p - B [target]
    - U - H p z over e's tokens (see the module docstring; h: the entropy's H, or None); dc, db and de may be None. Otherwise nothing
    moves. No host sync.

    e [N, D], c [V, D] (row strides, unit column stride); targets int64 [N], rows of c (outside
    [0, V) where not here); lse, a, b, u fp32 [N] (u may be None); scale fp32 [1], a power of two
    (kernels.grad_scale) for fp16, else 1; de [N, D] contiguous."""
    if de is not None and (de.shape != e.shape or not de.is_contiguous()):
        raise ValueError(f"de must be contiguous and shaped like e {tuple(e.shape)}")
    if e.shape[1] == 0 or (c.shape[0] == 0 and de is None) or (dc is None and db is None and de is None):
        return
    for name, t in (("e", e), ("c", c), ("dc", dc)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit column stride")
    key = (e.device, e.dtype)
    blocks = _FITTING.get(key, CUDA_BLOCKS if e.is_cuda else CPU_BLOCKS)
    while True:
        try:
            _launch(blocks, flag, e, c, bias, targets, lse, a, b, u, h, scale, dc, db, de, softcap, temperature,
                    add_dc)
            return
        except OutOfResources:
            blocks = _FITTING[key] = _smaller(blocks)
