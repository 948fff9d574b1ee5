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
- ``model(..., labels=labels, loss_weights=w)``: per-token weights [b, s] known before the forward
  (SFT token weights, RL advantages; any float dtype and sign). GPTModel.forward has no such
  argument, so the CCE model class takes this one keyword off the call and hands the weights,
  with the labels, to the output layer for that one forward; the model returns w · loss [b, s],
  and its gradients are made for that weighted loss in the forward (the caller then sums it, or
  divides it by one number, and the backward only scales them). A keyword rather than a context
  manager, like ``loss_mask``: it is visible at the call site, travels through Megatron's
  wrappers (DDP, Float16Module and Megatron-FSDP pass keywords on), belongs to exactly one forward
  (no weights left set for the next micro-batch, whatever raises), and a model that is not
  switched rejects it (TypeError) instead of ignoring it. Earlier pipeline stages ignore it, as
  they ignore the labels. With ``loss_mask`` too, masked tokens give 0 and the others their
  weighted loss.
- ``model(..., labels=labels, entropy_weights=h)``: h a number or [b, s] float weights known before
  the forward; the model returns loss + h · entropy per token (times loss_weights too where given:
  w · loss + h · entropy), each token's entropy at ``CCEOptions.temperature``, the gradients made
  for that in the forward (an RL entropy bonus, folded; the layer's ``per_token_loss``). The same
  keyword as loss_weights, routed and refused alike.

- ``model(..., labels=labels, return_log_probs=True)``: instead of the loss, {"log_probs": [b, s],
  "entropy": [b, s]} (fp32, differentiable, at ``CCEOptions.temperature``; 0 where loss_mask is 0
  or the label is ignore_index), what an RL framework's Megatron backend computes its policy loss
  from (verl's actor hands its loss function such a dict). A keyword for the reasons above. The
  layer returns the log-probs tensor in the logits' place, for megatron-core's code to hand on,
  and ``compute_language_model_loss`` makes the dict of it with the entropy of the same call.
  Refused (ValueError / TypeError): without labels, in inference, with loss_weights or
  entropy_weights, and with multi-token prediction (megatron-core would train the depths on a loss
  attached unseen to the output).

Multi-token prediction (``config.mtp_num_layers`` = n >= 1, the DeepSeek-V3 recipe; the MTP
layers on the last pipeline stage, as megatron-core places them): ``_postprocess`` runs the MTP
block, then calls the output layer on depth k's hidden states for k = 1 .. n, taking
``compute_language_model_loss(labels rolled k times, ·)`` times the loss_mask rolled k times,
over that mask's sum, times ``mtp_loss_scaling_factor / n``, attached to the graph by
``MTPLossAutoScaler``; then the main head's call. The CCE model computes the same rolled labels
and masks first (megatron-core's own ``roll_tensor``, with its context-parallel group and packed
sequences; ``loss_mask`` None is all ones, as there), folds each mask into its labels
(``mask_labels``) and routes them to the output layer ahead of the main head's
(``route_labels(labels, mtp_labels=...)``): each depth's loss is the layer's, computed without
its logits, and megatron-core's loop (the mask product, the count, the scale, the logging
tracker) runs on it unchanged. With the masks folded, each depth's upstream gradient is one
number over its kept tokens, which the one-pass loss only scales; each depth has its own
``UpstreamState`` (``output_layer.mtp_cce_states[k]``) and loss scale (layer.py). The routing
relies on megatron-core's order of calls (the depths, then the main head; 0.16 and 0.19 alike);
the layer raises RuntimeError after the forward if the calls did not use every label routed.
``loss_weights`` and ``entropy_weights`` weight the main head's loss only (the model returns it);
the depths' are megatron-core's, masked by ``loss_mask`` alone. megatron-core 0.19 also counts,
for logging, how often each depth's argmax is its label (the MTP "acceptance rate"): CCE builds
no logits to take an argmax of, so the CCE depths add nothing to those counts (the rate logs 0)
rather than numbers taken from the losses. Without labels (megatron-core 0.19 then derives them from the
input ids), and in inference, the model runs megatron-core's own MTP on logits.

Without labels, and in inference mode, the model returns logits [b, s, V/tp] (or gathered) as
Megatron does.
"""

import contextlib
import inspect

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper, roll_tensor

try:  # megatron-core 0.19: a process-wide flag, read by GPTModel._postprocess for inference
    from megatron.core.inference.utils import InferenceMode
except ImportError:  # megatron-core 0.16: inference is an inference_context outside training
    InferenceMode = None

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
        **options: the other fields of ``CCEOptions``: softcap, temperature, label_smoothing,
            z_loss, ignore_index, logits_budget, loss_scale, make_vocab_size_divisible_by.

    Afterwards ``model(input_ids, position_ids, attention_mask, labels=labels)`` returns the
    per-token fp32 loss [b, s] (labels [b, s]) and never builds the logits; without labels it
    returns logits as before. ``loss_weights=`` [b, s] weights that loss per token,
    ``entropy_weights=`` adds each token's entropy times them, and ``return_log_probs=True``
    returns {"log_probs", "entropy"} [b, s] instead (see the module doc). Calling it again
    replaces the options (with other options the output layer starts a fresh ``cce_state``).
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
    loss_weights: torch.Tensor | None = None,
    entropy_weights: float | torch.Tensor | None = None,
    return_log_probs: bool = False,
    runtime_gather_output: bool | None = None,
    **options,
) -> torch.Tensor | dict:
    """GPTModel's output step with CCE: hidden states -> per-token loss, or logits without labels.

    The function stands in for the output layer + ``compute_language_model_loss`` pair in a
    custom forward step (megatron-core 0.16.1's GPTModel has no output-processor hook).

    Args:
        model: the GPTModel (or a wrapper) of the last pipeline stage.
        hidden_states: [s, b, h], or [s/tp, b, h] with sequence parallelism (the decoder's output).
        labels: [b, s], or None for logits.
        loss_mask: [b, s] or None; where 0 the token's loss is 0 and it gets no gradient (folded
            into the labels with ``mask_labels``, as the model's forward folds its ``loss_mask``).
        loss_weights: [b, s] float per-token weights known before the forward, or None: the loss
            is then loss_weights · loss, its gradients made for it in the forward.
        entropy_weights: a number, or [b, s] float weights, or None: each token's entropy times them
            is added to its loss, the gradients made for that in the forward too.
        return_log_probs: return {"log_probs": [b, s], "entropy": [b, s]} (fp32, at the options'
            temperature; 0 where masked or ignored) instead of the loss; needs labels.
        runtime_gather_output: as in GPTModel.forward (logits only).
        **options: ``use_cce`` options (impl, softcap, ...); applied to the model first when given,
            or when its output layer is not a CCE layer yet.

    Returns:
        loss [b, s] float32 per token (times loss_weights, plus entropy_weights · entropy), or the
        dict of return_log_probs; without labels, logits [b, s, V/tp] (or [b, s, V] gathered).
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
        hidden_states,
        weight=weight,
        runtime_gather_output=runtime_gather_output,
        labels=labels,
        loss_weights=loss_weights,
        entropy_weights=entropy_weights,
        return_log_probs=return_log_probs,
    )
    if labels is None:
        return out.transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V], as GPTModel returns logits
    return out


# ---------------------------------------------------------------------------------------------


class _CCEGPTModelMixin:
    """Routes labels (and loss_weights, entropy_weights) to the CCE output layer for
    GPTModel._postprocess (see the module doc)."""

    _cce_loss_weights = None  # set by forward for its own call only
    _cce_entropy_weights = None  # likewise
    _cce_return_log_probs = False  # likewise

    def forward(
        self,
        *args,
        loss_weights: torch.Tensor | None = None,
        entropy_weights: float | torch.Tensor | None = None,
        return_log_probs: bool = False,
        **kwargs,
    ):
        """GPTModel.forward, plus ``loss_weights`` [b, s] and ``entropy_weights`` (a number or
        [b, s]) for the per-token loss, or ``return_log_probs`` for {"log_probs": [b, s], "entropy":
        [b, s]} instead (module doc)."""
        if not isinstance(return_log_probs, bool):
            raise TypeError(f"return_log_probs must be a bool, got {return_log_probs!r}")
        if loss_weights is None and entropy_weights is None and not return_log_probs:
            return super().forward(*args, **kwargs)
        self._cce_loss_weights, self._cce_entropy_weights = loss_weights, entropy_weights
        self._cce_return_log_probs = return_log_probs
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._cce_loss_weights = self._cce_entropy_weights = None
            self._cce_return_log_probs = False

    def _postprocess(self, *args, **kwargs):
        bound = _postprocess_signature(type(self)).bind_partial(self, *args, **kwargs).arguments
        labels = bound.get("labels")
        inference = (bound.get("inference_context") is not None and not self.training) or _inference_mode_active()
        layer = getattr(self, "output_layer", None)
        loss_weights, entropy_weights = self._cce_loss_weights, self._cce_entropy_weights
        log_probs = self._cce_return_log_probs
        if labels is None or inference or not self.post_process or not isinstance(layer, CCEOutputLayer):
            if (loss_weights is not None or entropy_weights is not None or log_probs) and self.post_process:
                why = (
                    "it has no labels" if labels is None
                    else "inference mode" if inference
                    else f"the output layer is a {type(layer).__name__}, not a CCE layer"
                )
                what, instead = (
                    ("loss_weights weight the per-token loss", "no loss_weights") if loss_weights is not None
                    else ("entropy_weights add each token's entropy to its loss", "no entropy_weights")
                    if entropy_weights is not None
                    else ("return_log_probs returns the labels' log-probs", "no return_log_probs")
                )
                raise ValueError(
                    f"{what}, but this forward computes no CCE loss ({why}); pass labels, or {instead}"
                )
            return super()._postprocess(*args, **kwargs)
        if log_probs:  # (with loss_weights or entropy_weights too: route_labels refuses them)
            depths = getattr(self.config, "mtp_num_layers", None)
            if depths:
                raise ValueError(
                    f"return_log_probs is not supported with multi-token prediction (mtp_num_layers={depths}): "
                    "the forward would also train the MTP depths on megatron-core's loss, attached unseen to "
                    "the main head's output; take the loss (no return_log_probs), or score and train the "
                    "policy built without MTP layers"
                )
        loss_mask = bound.get("loss_mask")
        mtp_labels = self._cce_mtp_labels(labels, loss_mask, bound.get("packed_seq_params"))
        if loss_mask is not None:
            # Megatron's loss_func multiplies the per-token loss by this mask; folded into the labels,
            # masked tokens give exactly 0 (the product is unchanged) and no gradient, so the
            # upstream gradient is one number over the kept tokens (see the module doc).
            labels = mask_labels(labels, loss_mask, layer.cce_options.ignore_index)
        routed = layer.route_labels(
            labels, loss_weights, mtp_labels=mtp_labels, return_log_probs=log_probs,
            entropy_weights=entropy_weights,
        )
        with routed, _no_acceptance_counts(mtp_labels):
            return super()._postprocess(*args, **kwargs)

    def _cce_mtp_labels(self, labels, loss_mask, packed_seq_params) -> list:
        """[l_1, ..., l_n]: the labels of MTP depth k, as megatron-core's loop rolls them (k times,
        along the sequence), with its loss_mask rolled alike folded in (module doc); [] without MTP."""
        depths = getattr(self.config, "mtp_num_layers", None) or 0
        ignore_index = self.output_layer.cce_options.ignore_index
        mask = loss_mask if loss_mask is not None else torch.ones_like(labels)
        cp_group = self.pg_collection.cp
        out = []
        for _ in range(depths):
            labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
            mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
            out.append(mask_labels(labels, mask, ignore_index))
        return out

    def compute_language_model_loss(self, labels, logits):
        layer = getattr(self, "output_layer", None)
        if isinstance(layer, CCEOutputLayer) and layer.is_routed_loss(logits):
            # already the per-token loss [b, s], or the log-probs [b, s] to return with their entropy
            return layer.routed_output(logits)
        return super().compute_language_model_loss(labels, logits)


def _inference_mode_active() -> bool:
    return InferenceMode is not None and InferenceMode.is_active()


@contextlib.contextmanager
def _no_acceptance_counts(mtp_labels):
    """megatron-core 0.19 adds, per MTP depth in training, how many of the depth's argmax
    predictions hit their label to ``MTPLossLoggingHelper.tracker`` (correct_values, total_values).
    Taken from a CCE depth's output (its loss, not logits) the count would be meaningless: the
    block leaves the counts as they were, so the CCE depths add nothing to them (module doc)."""
    tracker = getattr(MTPLossLoggingHelper, "tracker", None)
    keys = ("correct_values", "total_values")
    if not mtp_labels or not isinstance(tracker, dict):
        yield
        return
    before = {k: tracker[k].clone() for k in keys if isinstance(tracker.get(k), torch.Tensor)}
    try:
        yield
    finally:
        for key in keys:
            counts = tracker.get(key)
            if not isinstance(counts, torch.Tensor):
                continue
            if key in before:
                counts.copy_(before[key])
            else:  # made by this forward
                counts.zero_()


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
    config = gpt.config
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        # megatron-core >= 0.19 multiplies the output layer's result by it (GPTModel._scale_logits),
        # which for a CCE layer is the loss, not the logits.
        raise NotImplementedError(
            f"use_cce does not support MuP's output scaling (use_mup with mup_output_mult={config.mup_output_mult})"
        )
    if gpt.post_process:
        CCEOutputLayer.convert(gpt.output_layer, options)
    gpt.__class__ = _model_class(type(gpt))
