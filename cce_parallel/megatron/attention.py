"""SDPAttention: a megatron-core core attention on torch's scaled_dot_product_attention.

Shapes (Megatron's layout, this rank's heads under tensor parallelism):
    query  [sq, b, np, hn]     np = num_attention_heads / tp
    key    [sk, b, ng, hn]     ng = num_query_groups / tp (grouped-query attention when ng < np)
    value  [sk, b, ng, hn]
    attention_mask  None, or bool [b or 1, 1, sq, sk] with True = masked out (Megatron's convention)
    returns [sq, b, np * hn]

It runs wherever SDPA runs: on CPU (the math kernel), and on GPUs through the flash or
memory-efficient kernels, with no Transformer Engine and no apex. megatron-core's own local
``DotProductAttention`` builds the [b, np, sq, sk] score matrix and its causal mask on CUDA only.

Masking follows ``DotProductAttention``: an explicit mask wins; without one, ``AttnMaskType.causal``
means a causal mask, anything else no mask.

Gemma 2's attention (``softcap``, ``sliding_window``; causal, no explicit mask, no dropout):
    scores = q·kᵀ · scale;  scores = softcap · tanh(scores / softcap)
    key j is seen by query i when j <= i and i - j < sliding_window (window layers only)
The window applies to the layers with an odd ``layer_number`` (1, 3, ...: megatron-core numbers
layers from 1 over the whole model, pipeline stages included), the others attend globally, as
Gemma 2 alternates them from its first layer. On CUDA this is torch's ``flex_attention``, compiled
(the softcap a ``score_mod``, causality and the window a block mask, cached per sequence length,
so fully masked tiles are skipped); elsewhere, where flex_attention has no backward, the same
math on the materialized [b, np, sq, sk] scores, in fp32. A layer with neither keeps SDPA. The softmax scale is ``config.softmax_scale`` or
1/sqrt(hn) (``apply_query_key_layer_scaling`` only rescales inside Megatron's fp16 softmax and
cancels out, so it is ignored here). Attention dropout draws from the tensor-parallel RNG tracker
(a different stream per TP rank, as Megatron does) when it is initialized.
"""

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Core attention (the part between the QKV and output projections) on SDPA.

    Built by megatron-core from a layer spec (``SelfAttentionSubmodules.core_attention``) with
    the keyword arguments below; see ``cce_parallel.megatron.local_gpt_layer_spec``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism (context_parallel_size > 1)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPAttention does not support sliding-window attention (window_size)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window!r}")
        self.softcap = softcap
        # Gemma 2: the window on layers 1, 3, ... (layer_number counts from 1 over all stages).
        self.window = sliding_window if sliding_window is not None and self.layer_number % 2 == 1 else None
        if (self.softcap is not None or self.window is not None) and self.dropout_p > 0:
            raise ValueError("attention softcap / sliding window: attention dropout is not supported")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        sq, b, n_heads, head_dim = query.shape
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, heads, hn] -> [b, heads, s, hn]: the layout SDPA takes (a view, no copy).
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        attn_mask, is_causal = None, False
        if attention_mask is not None:
            attn_mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != key.shape[0]:
                raise ValueError(f"a causal mask needs sq == sk, got {sq} and {key.shape[0]}")
            is_causal = True
        if self.softcap is not None or self.window is not None:
            if attention_mask is not None or mask_type != AttnMaskType.causal or sq != key.shape[0]:
                raise ValueError("attention softcap / sliding window: causal self-attention without an explicit "
                                 "attention_mask only")
            out = capped_attention(q, k, v, scale=self.softmax_scale, softcap=self.softcap, window=self.window)
            return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = k.shape[1] != n_heads
        if gqa:
            # Grouped-query attention: repeat each key/value group over its query heads.
            k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
            v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
        with _dropout_rng(dropout_p, self.config.sequence_parallel, query.device):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)


def capped_attention(q, k, v, *, scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """Causal attention with a logit softcap and/or a sliding window (see the module doc).
    q [b, np, s, hn], k and v [b, ng, s, hn] (np a multiple of ng) -> [b, np, s, hn]."""
    if q.is_cuda:
        return _compiled_flex_attention()(
            q, k, v, score_mod=_softcap_mod(softcap), block_mask=_block_mask(q.shape[2], window, q.device),
            scale=scale, enable_gqa=k.shape[1] != q.shape[1],
            kernel_options=_WIDE_HEADS if q.shape[-1] > 128 else None,
        )
    return math_capped_attention(q, k, v, scale=scale, softcap=softcap, window=window)


# flex_attention's tiles for heads wider than 128 (Gemma 2: 256): fwd+bwd at b 4, s 2048, 8 / 4
# heads on an H100 took 2.13 ms with these, 2.80 ms with its defaults (SDPA's flash, causal
# without softcap: 0.99 ms).
_WIDE_HEADS = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def math_capped_attention(q, k, v, *, scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """``capped_attention`` on materialized scores (fp32): the CPU path, and the tests' reference."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    s = q.shape[2]
    i = torch.arange(s, device=q.device)
    keep = i[None, :] <= i[:, None]
    if window is not None:
        keep = keep & (i[:, None] - i[None, :] < window)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


@functools.lru_cache(maxsize=16)  # one function per softcap: torch.compile guards on its identity
def _softcap_mod(softcap: float | None):
    if softcap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def _block_mask(s: int, window: int | None, device: torch.device):
    """flex_attention's block mask for causal attention within `window` (None: causal only)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    # _compile: evaluated block by block; eager would materialize the s x s mask (17 GB at 128k).
    return create_block_mask(sliding if window is not None else causal, None, None, s, s, device=device, _compile=True)


def _dropout_rng(dropout_p: float, sequence_parallel: bool, device: torch.device):
    """Megatron's model-parallel RNG stream for attention dropout (CUDA, tracker initialized)."""
    if dropout_p == 0.0 or sequence_parallel or device.type != "cuda":
        return contextlib.nullcontext()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if not getattr(tracker, "is_initialized", lambda: False)():
        return contextlib.nullcontext()
    return tracker.fork()
