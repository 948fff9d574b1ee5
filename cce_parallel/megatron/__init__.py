"""megatron-core glue: CCE as GPTModel's output layer + loss (the only package importing megatron.core).

    use_cce(gpt_model, impl="cce_kahan_full_c", **options)   switch an existing GPTModel, in place
    cce_output_processor(model, hidden [s(/tp), b, h], labels [b, s])  -> loss [b, s] (or logits)
    model(..., labels=labels, loss_weights=w [b, s])          a switched model: w · loss per token
    model(..., labels=labels, entropy_weights=h)              + h · entropy per token (h: number or [b, s])
    model(..., labels=labels, return_log_probs=True)          {"log_probs", "entropy"} [b, s] (RL)
    CCEOutputLayer, CCEOptions                                the layer itself and its options
    mask_labels(labels, loss_mask)                            fold loss_mask into ignore_index
    local_gpt_layer_spec(), local_gpt_block_spec(config)      a TE-free, apex-free local spec
    SDPAttention, LocalNorm                                   its core attention and norm

Needs the ``megatron`` extra (``pip install cce-parallel[megatron]``); ``import cce_parallel``
works without it.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "cce_parallel.megatron needs megatron-core: pip install 'cce-parallel[megatron]' "
        "(or megatron-core); the rest of cce_parallel works without it"
    ) from err

from cce_parallel.megatron.attention import SDPAttention
from cce_parallel.megatron.layer import (
    CCEOptions,
    CCEOutputLayer,
    check_vocab_divisible,
    mask_labels,
    padded_vocab_size,
)
from cce_parallel.megatron.model import cce_output_processor, unwrap_gpt_model, use_cce
from cce_parallel.megatron.spec import LocalNorm, local_gpt_block_spec, local_gpt_layer_spec

__all__ = [
    "CCEOptions",
    "CCEOutputLayer",
    "LocalNorm",
    "SDPAttention",
    "cce_output_processor",
    "check_vocab_divisible",
    "local_gpt_block_spec",
    "local_gpt_layer_spec",
    "mask_labels",
    "padded_vocab_size",
    "unwrap_gpt_model",
    "use_cce",
]
