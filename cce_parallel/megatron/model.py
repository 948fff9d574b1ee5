"""use_cce: switch a megatron-core GPTModel's output path to CCE; cce_output_processor: the same
step as a function of (model, hidden states, labels).

GPTModel (megatron-core 0.16.1) ends in ``_postprocess``, which calls
``logits, _ = self.output_layer(hidden [s(/tp), b, h], weight=..., runtime_gather_output=...)``
and then ``self.compute_language_model_loss(labels [b, s], logits)`` -> loss [b, s]. That version
has no ``output_processor`` hook in ``GPTModel.forward``, so ``use_cce`` does the equivalent in place:

- the output layer becomes a ``CCEOutputLayer`` (same object, parameters and hooks);
- the model's class becomes a subclass whose ``_postprocess`` routes the labels to the output
  layer for that one call, so the loss [b, s] is computed inside the output layer's own
  ``forward`` (DDP / FSDP pre-hooks fire as for the logits), and whose
  ``compute_language_model_loss`` passes that loss through. Everything else in ``_postprocess``
  (the shared-weight lookup, inference, logging) is megatron-core's own.
- ``GPTModel.forward(..., labels=labels, loss_mask=loss_mask)`` (megatron-core 0.16 and 0.19 take
  the keyword and hand it to ``_postprocess``, where only multi-token prediction reads it;
  Megatron-LM's ``pretrain_gpt`` passes it): the routed labels are ``mask_labels(labels,
  loss_mask)``, so masked tokens get ``ignore_index``: a loss of exactly 0 and no gradient. The
  caller's ``(loss * loss_mask).sum() / count`` is then the same number with the same gradients,
  and its upstream gradient is one number over the kept tokens, which the one-pass loss only
  scales (without the fold it is per token, and the backward recomputes ∇weight). A loop that
  does not pass ``loss_mask`` to the model folds it itself with ``mask_labels``.

Without labels, and in inference mode, the model returns logits [b, s, V/tp] (or gathered) as
Megatron does. Multi-token prediction is not supported (its extra heads roll the labels).
"""

import inspect

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from cce_parallel.megatron.layer import CCEOptions, CCEOutputLayer, mask_labels


def unwrap_gpt_model(model) -> GPTModel:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module, ...: ``.module`` chains)."""
    inner, seen = model, 0
    while not isinstance(inner, GPTModel) and hasattr(inner, "module") and seen < 8:
        inner, seen = inner.module, seen + 1
    if not isinstance(inner, GPTModel):
        raise TypeError(
            f"expected a megatron-core GPTModel (or a wrapper of one), got {type(model).__name__}"
        )
    return inner


def use_cce(model, impl: str = "cce_kahan_full_c", **options):
    """Make `model` compute its loss with CCE; returns `model`. In place and idempotent.

    Args:
        model: a megatron-core GPTModel, a wrapper of one (DDP, Float16Module), or a list of
            model chunks (virtual pipeline stages). Call it before or after wrapping.
        impl: one of ``cce_parallel.IMPLS``.
        **options: the other fields of ``CCEOptions``: softcap, label_smoothing, z_loss,
            ignore_index, logits_budget, loss_scale, make_vocab_size_divisible_by.

    Afterwards ``model(input_ids, position_ids, attention_mask, labels=labels)`` returns the
    per-token fp32 loss [b, s] (labels [b, s]) and never builds the logits; without labels it
    returns logits as before. Calling it again replaces the options.
    """
    opts = CCEOptions(impl=impl, **options)
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        _convert(unwrap_gpt_model(chunk), opts)
    return model


def cce_output_processor(
    model,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    loss_mask: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
    **options,
) -> torch.Tensor:
    """GPTModel's output step with CCE: hidden states -> per-token loss, or logits without labels.

    The function stands in for the output layer + ``compute_language_model_loss`` pair in a
    custom forward step (megatron-core 0.16.1's GPTModel has no output-processor hook).

    Args:
        model: the GPTModel (or a wrapper) of the last pipeline stage.
        hidden_states: [s, b, h], or [s/tp, b, h] with sequence parallelism (the decoder's output).
        labels: [b, s], or None for logits.
        loss_mask: [b, s] or None; where 0 the token's loss is 0 and it gets no gradient (folded
            into the labels with ``mask_labels``, as the model's forward folds its ``loss_mask``).
        runtime_gather_output: as in GPTModel.forward (logits only).
        **options: ``use_cce`` options (impl, softcap, ...); applied to the model first when given,
            or when its output layer is not a CCE layer yet.

    Returns:
        loss [b, s] float32 per token; without labels, logits [b, s, V/tp] (or [b, s, V] gathered).
    """
    gpt = unwrap_gpt_model(model)
    if not gpt.post_process:
        raise ValueError("cce_output_processor needs the last pipeline stage (post_process=True)")
    if options or not isinstance(gpt.output_layer, CCEOutputLayer):
        use_cce(gpt, **options)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    if labels is not None and loss_mask is not None:
        labels = mask_labels(labels, loss_mask, gpt.output_layer.cce_options.ignore_index)
    out, _ = gpt.output_layer(
        hidden_states, weight=weight, runtime_gather_output=runtime_gather_output, labels=labels
    )
    if labels is None:
        return out.transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V], as GPTModel returns logits
    return out


# ---------------------------------------------------------------------------------------------


class _CCEGPTModelMixin:
    """Routes labels to the CCE output layer for GPTModel._postprocess (see the module doc)."""

    def _postprocess(self, *args, **kwargs):
        bound = _postprocess_signature(type(self)).bind_partial(self, *args, **kwargs).arguments
        labels = bound.get("labels")
        inference = bound.get("inference_context") is not None and not self.training
        layer = getattr(self, "output_layer", None)
        if labels is None or inference or not self.post_process or not isinstance(layer, CCEOutputLayer):
            return super()._postprocess(*args, **kwargs)
        loss_mask = bound.get("loss_mask")
        if loss_mask is not None:
            # Megatron's loss_func multiplies the per-token loss by this mask; folded into the labels,
            # masked tokens give exactly 0 (the product is unchanged) and no gradient, so the
            # upstream gradient is one number over the kept tokens (see the module doc).
            labels = mask_labels(labels, loss_mask, layer.cce_options.ignore_index)
        with layer.route_labels(labels):
            return super()._postprocess(*args, **kwargs)

    def compute_language_model_loss(self, labels, logits):
        layer = getattr(self, "output_layer", None)
        if isinstance(layer, CCEOutputLayer) and layer.is_routed_loss(logits):
            return logits  # already the per-token loss [b, s]
        return super().compute_language_model_loss(labels, logits)


_MODEL_CLASSES = {}
_SIGNATURES = {}


def _postprocess_signature(cls) -> inspect.Signature:
    """The signature of the GPTModel ``_postprocess`` the mixin wraps (self included)."""
    if cls not in _SIGNATURES:
        base = next(
            (
                vars(k)["_postprocess"]
                for k in cls.__mro__
                if "_postprocess" in vars(k) and k is not _CCEGPTModelMixin
            ),
            None,
        )
        if base is None:
            raise TypeError(f"{cls.__name__} has no _postprocess: not a megatron-core GPTModel")
        _SIGNATURES[cls] = inspect.signature(base)
    return _SIGNATURES[cls]


def _model_class(cls: type) -> type:
    if issubclass(cls, _CCEGPTModelMixin):
        return cls
    if cls not in _MODEL_CLASSES:
        _MODEL_CLASSES[cls] = type(f"CCE{cls.__name__}", (_CCEGPTModelMixin, cls), {"__module__": __name__})
    return _MODEL_CLASSES[cls]


def _convert(gpt: GPTModel, options: CCEOptions):
    if getattr(gpt.config, "mtp_num_layers", None):
        raise NotImplementedError("use_cce does not support multi-token prediction (mtp_num_layers)")
    if gpt.post_process:
        CCEOutputLayer.convert(gpt.output_layer, options)
    gpt.__class__ = _model_class(type(gpt))
