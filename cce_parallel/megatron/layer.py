"""CCEOutputLayer: megatron-core's output layer (a ColumnParallelLinear) fused with the loss.

Shapes (s: sequence, b: micro-batch, h: hidden, V: the padded vocabulary, tp: tensor-parallel size):
    input_   [s, b, h], or [s/tp, b, h] with sequence parallelism (this rank's slice along s)
    weight   [V/tp, h]: this rank's rows [r·V/tp, (r+1)·V/tp) of the output weight, Megatron's layout
    labels   [b, s] integer ids in [0, V), as GPTModel gets them
    loss_weights  optional [b, s] float per-token weights, known before the forward (any sign)
    entropy_weights  optional, a number or [b, s] float per-token weights of each token's entropy
    returns  with labels: (loss [b, s] float32 per token, unreduced, None), loss_weights · loss where
             given, plus entropy_weights · entropy where given; with return_log_probs
             ({"log_probs": [b, s], "entropy": [b, s]}, None), both float32 at the options'
             temperature; the logits are never built.
             without labels: ColumnParallelLinear's own (logits [s, b, V/tp] or gathered [s, b, V], bias).

With labels the loss is ``cce_parallel.linear_cross_entropy(input_, weight, labels.T, reduction="none",
weights=loss_weights.T, entropy_weights=entropy_weights.T, state=layer.cce_state, tp_group=...,
sequence_parallel=...)``: the same value
as Megatron's ``ColumnParallelLinear`` followed by ``vocab_parallel_cross_entropy`` (times the
weights), over the whole padded vocabulary as Megatron computes it (padding rows are trainable rows
of the weight in Megatron, and their logits enter the softmax there too).
∇input is summed over the tensor-parallel group (reduce-scattered under sequence parallelism), as
the linear layer's all-reduce / reduce-scatter does; ∇weight is this rank's shard.

∇weight follows Megatron's linear layers: with ``gradient_accumulation_fusion`` and a
``weight.main_grad`` (Megatron DDP), the loss adds it into ``main_grad`` in fp32 straight from its
fp32 accumulator (no bf16 copy of ∇weight is made), ``weight.grad_added_to_main_grad`` is set, and
the weight gets a dummy gradient (zeros where Megatron asks for them with ``zero_out_wgrad``: a tied
embedding on the same stage, whose lookup gradient DDP's hook still adds). Otherwise the weight gets
its gradient, and DDP's hooks add it.

Speed: the loss computes its gradients in the forward and scales them in the backward when the
upstream gradient is one number over the kept tokens. Megatron's loss_func multiplies the per-token
loss by ``loss_mask`` and divides by a count: the mask must be folded into the labels
(``mask_labels(labels, loss_mask)``), else the backward recomputes ∇weight. A model switched by
``use_cce`` folds the ``loss_mask`` that ``GPTModel.forward`` receives (Megatron-LM's
``pretrain_gpt`` passes it); a loop that does not pass it to the model folds it itself (the train
job does).
Without gradient-accumulation fusion a bf16 ∇weight is made in the forward for the number the loss
is scaled by; Megatron's schedule divides it by the number of micro-batches, so pass
``CCEOptions(loss_scale=1 / num_microbatches)`` (the train job does), or the first backward
recomputes ∇weight.
Per-token weights that are not a 0/1 mask (SFT token weights, RL advantages) go in as
``loss_weights``: the gradients are then made for the weighted loss in the forward, and the caller
sums the returned loss (or divides it by one number) with no recompute. Multiplying the loss by
them afterwards gives the same numbers, but the backward recomputes ∇weight. ``entropy_weights``
(a number, or [b, s]) add each token's entropy at the temperature times them to its loss (an RL
entropy bonus, negative), its gradients made in the forward alike: linear_cross_entropy's
``entropy_weights``.

Post-training (RL): ``forward(hidden, labels=labels, return_log_probs=True)`` (or
``per_token_log_probs``) returns each token's log p(label) and its distribution's entropy at
``CCEOptions.temperature``, vocab-parallel, differentiable: ``linear_cross_entropy(...,
return_entropy=True)``, its loss negated, on the lean path (no gradients made in the forward: the
objective of them is not known there, and the backward recomputes). It needs a loss that is the
cross-entropy alone (no label_smoothing, no z_loss) and no loss_weights or entropy_weights.

State: the layer owns a ``cce_parallel.UpstreamState``, ``layer.cce_state``, passed to every call:
what its backwards taught it (per-token weights that come only in the backward make its later
calls leave ∇weight to the backward, a mask makes them compute fp32 gradients, a bf16 ∇weight made
for another number teaches the loss scale) and a Counter of the paths taken (``cce_state.paths``). It shows in the layer's repr;
``reset_cce_state()`` forgets it. No other layer, and no plain ``linear_cross_entropy`` call, sees it.

Multi-token prediction (``config.mtp_num_layers`` = n): GPTModel calls the layer once per MTP depth
and then once for the main head in the same forward (see ``cce_parallel.megatron.model``).
``route_labels(labels, mtp_labels=[l_1, ..., l_n])`` hands the first n calls without labels the
depths' labels, in order, then the main head its own (with its loss_weights and entropy_weights).
Depth k's upstream gradient is another number than the main head's (megatron scales its loss by
``mtp_loss_scaling_factor / mtp_num_layers``), so it has a state of its own,
``layer.mtp_cce_states[k]`` (k = 1 .. n, megatron's ``mtp_k loss``): what depth k's
backwards teach never reaches the main head's ``cce_state``, nor another depth's. Its loss scale
is ``CCEOptions.loss_scale · mtp_loss_scaling_factor / mtp_num_layers`` where the option is given
(and ``calculate_per_token_loss`` is off), else what its state learned. The repr shows these
states; ``reset_cce_state()`` forgets them too.
"""

import contextlib
import dataclasses
import math
from numbers import Real

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.utils import get_pg_size, get_tensor_model_parallel_group_if_none

from cce_parallel.ops import IMPLS
from cce_parallel.ops.functional import resolve_logits_budget
from cce_parallel.ops.upstream import UpstreamState, check_loss_scale
from cce_parallel.parallel import linear_cross_entropy
from cce_parallel.parallel.dtensor import any_dtensor


@dataclasses.dataclass(frozen=True)
class CCEOptions:
    """The loss options of a CCE output layer (see ``cce_parallel.linear_cross_entropy``)."""

    impl: str = "cce_kahan_full_c"
    """One of ``cce_parallel.IMPLS``; the paper's pretraining choice by default."""
    softcap: float | None = None
    """Soft-capping of the logits, ``softcap · tanh(logit / softcap)``; None: off."""
    temperature: float = 1.0
    """The logits are divided by it before the softcap (a sampler's temperature: per-token losses
    are then the negated target log-probs at that temperature)."""
    label_smoothing: float = 0.0
    """In [0, 1), over the full (padded) vocabulary. Megatron's GPT loss has none."""
    z_loss: float = 0.0
    """Adds ``z_loss · lse²`` per token."""
    ignore_index: int = -100
    """Labels equal to it get zero loss and no gradient (Megatron masks with ``loss_mask`` instead;
    ``mask_labels`` folds that mask into the labels)."""
    logits_budget: str | int = "auto"
    """Bytes of the logits buffer per token block of the one-pass loss: "auto", a number, or "lean" / 0
    (recompute the logits in the backward; least memory)."""
    loss_scale: float | None = None
    """What the schedule multiplies the loss by before its backward (``1 / num_microbatches``): a bf16
    ∇weight made in the forward (no gradient-accumulation fusion) is made for it. None: the number in
    the layer's state, ``layer.cce_state.loss_scale`` (1 until a backward brings another; set it
    beforehand with ``layer.cce_state.expect_loss_scale(x)``)."""
    make_vocab_size_divisible_by: int | None = None
    """If set, the layer's (padded) vocabulary must be a multiple of it times tp, as Megatron-LM's
    ``--make-vocab-size-divisible-by`` pads it; a layer whose vocabulary is not raises ValueError."""

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"unknown impl {self.impl!r}; choose one of {', '.join(IMPLS)}")
        if self.softcap is not None and (
            not _is_real(self.softcap) or not math.isfinite(self.softcap) or self.softcap <= 0
        ):
            raise ValueError(f"softcap must be a finite positive number or None, got {self.softcap!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be a finite positive number, got {self.temperature!r}")
        if not _is_real(self.label_smoothing) or not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if not _is_real(self.z_loss) or not math.isfinite(self.z_loss) or self.z_loss < 0:
            raise ValueError(f"z_loss must be a finite number >= 0, got {self.z_loss!r}")
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        resolve_logits_budget(self.logits_budget)
        if self.loss_scale is not None:
            check_loss_scale(self.loss_scale)
        m = self.make_vocab_size_divisible_by
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"make_vocab_size_divisible_by must be a positive int or None, got {m!r}")

    def loss_kwargs(self) -> dict:
        return {
            "impl": self.impl,
            "softcap": self.softcap,
            "temperature": self.temperature,
            "label_smoothing": self.label_smoothing,
            "z_loss": self.z_loss,
            "ignore_index": self.ignore_index,
            "logits_budget": self.logits_budget,
            "loss_scale": self.loss_scale,
        }


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """The vocabulary Megatron-LM builds for ``vocab_size`` tokens: rounded up to a multiple of
    ``make_vocab_size_divisible_by · tp`` (its ``_vocab_size_with_padding``)."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_vocab_divisible(vocab_size: int, tp: int, make_vocab_size_divisible_by: int | None = None):
    """Raise ValueError unless the (padded) vocabulary splits as the config says."""
    multiple = tp * (make_vocab_size_divisible_by or 1)
    if vocab_size % multiple:
        what = f"tensor_model_parallel_size={tp}"
        if make_vocab_size_divisible_by:
            what = f"make_vocab_size_divisible_by={make_vocab_size_divisible_by} × {what}"
        raise ValueError(
            f"vocabulary size {vocab_size} is not divisible by {multiple} ({what}); pad it to "
            f"{padded_vocab_size(vocab_size, make_vocab_size_divisible_by or 1, tp)} rows, as Megatron-LM's "
            "--make-vocab-size-divisible-by does (the extra rows are ordinary, trainable rows)"
        )


def mask_labels(labels: torch.Tensor, loss_mask: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels with ``ignore_index`` where ``loss_mask`` is 0: the loss then gives those tokens zero
    loss and no gradient, and Megatron's ``(loss * loss_mask).sum() / count`` becomes one number times
    the per-token loss over the kept tokens, which the one-pass loss scales without recomputing."""
    if loss_mask.shape != labels.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must have the labels' shape {tuple(labels.shape)}")
    return labels.masked_fill(loss_mask == 0, ignore_index)


class _MainGradHook(torch.autograd.Function):
    """Identity on the weight whose backward hands DDP a dummy gradient after the loss has added ∇W
    into ``weight.main_grad`` (Megatron's gradient-accumulation fusion), as Megatron's linear layers
    do; the loss itself gives the weight no gradient (see ``per_token_loss``), so this receives None."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor):
        ctx.set_materialize_grads(False)  # no [V/tp, h] zeros for the None the loss hands back
        ctx.weight_param = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_weight):
        weight = ctx.weight_param
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        # DDP's hook must still run on this thread (overlap_grad_reduce), so the weight gets a
        # gradient; zeros where the hook adds it (a tied embedding on the same stage).
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        dummy = make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
        weight.grad_added_to_main_grad = True
        return dummy


class _AccumulateIntoMainGrad(torch.autograd.Function):
    """Identity on the weight whose backward adds ∇W into a fresh Megatron-FSDP main-grad buffer
    (``weight.get_main_grad()``), then returns what ``_MainGradHook`` returns."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor):
        ctx.weight_param = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_weight: torch.Tensor):
        weight = ctx.weight_param
        weight.main_grad = weight.get_main_grad()
        weight.main_grad.copy_(grad_weight)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        return torch.empty(weight.main_grad.shape, dtype=grad_weight.dtype, device=grad_weight.device)


class CCEOutputLayer(ColumnParallelLinear):
    """A ColumnParallelLinear that, given labels, returns the per-token CCE loss instead of logits.

    Construct it like ``ColumnParallelLinear`` (plus ``cce_options``), or convert an existing
    output layer in place with ``CCEOutputLayer.convert(layer, options)``; ``use_cce`` does that
    for a GPTModel. Parameters, their tensor-parallel attributes (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``, ``allreduce``, ...) and the state dict are
    ColumnParallelLinear's, unchanged.

    ``cce_state`` is the layer's ``UpstreamState`` (see the module doc), shown by its repr and
    cleared by ``reset_cce_state()``; it is not part of the state dict.
    """

    def __init__(self, input_size: int, output_size: int, *, cce_options: CCEOptions | None = None, **kwargs):
        options = cce_options or CCEOptions()
        tp_group = get_tensor_model_parallel_group_if_none(
            kwargs.get("tp_group"), is_expert=kwargs.get("is_expert", False)
        )
        check_vocab_divisible(output_size, get_pg_size(tp_group), options.make_vocab_size_divisible_by)
        super().__init__(input_size, output_size, **kwargs)
        self._setup_cce(options)

    @classmethod
    def convert(cls, layer: ColumnParallelLinear, options: CCEOptions | None = None) -> "CCEOutputLayer":
        """Turn `layer` into a CCE output layer in place (its class changes; its parameters,
        attributes and any hooks stay) and return it. Converting again only replaces the options:
        with the same options the layer keeps its ``cce_state``; with other options it starts a
        fresh one (what it learned was learned for the old options)."""
        if not isinstance(layer, ColumnParallelLinear):
            raise TypeError(
                f"expected megatron-core's ColumnParallelLinear output layer, got {type(layer).__name__}"
            )
        options = options or CCEOptions()
        if getattr(layer, "is_expert", False):
            raise ValueError("an expert-parallel ColumnParallelLinear cannot be a CCE output layer")
        check_vocab_divisible(
            layer.output_size, get_pg_size(layer.tp_group), options.make_vocab_size_divisible_by
        )
        if not isinstance(layer, CCEOutputLayer):
            layer.__class__ = _cce_class(type(layer))
        layer._setup_cce(options)
        return layer

    def _setup_cce(self, options: CCEOptions):
        if not isinstance(options, CCEOptions):
            raise TypeError(f"cce_options must be a CCEOptions, got {type(options).__name__}")
        if self.config.defer_embedding_wgrad_compute:
            raise ValueError(
                "defer_embedding_wgrad_compute defers the output layer's weight-gradient GEMM; CCE computes "
                "that gradient inside its kernels. Turn the option off to use a CCE output layer"
            )
        if getattr(self, "cce_state", None) is None or options != getattr(self, "cce_options", None):
            self.cce_state = UpstreamState()
            # One state per multi-token-prediction depth k = 1 .. mtp_num_layers (see the module doc).
            depths = getattr(self.config, "mtp_num_layers", None) or 0
            self.mtp_cce_states = {k: UpstreamState() for k in range(1, depths + 1)}
        self.cce_options = options
        self._cce_pending_labels = None  # labels routed here by GPTModel._postprocess (see use_cce)
        self._cce_pending_weights = None  # and their per-token weights (loss_weights)
        self._cce_pending_entropy_weights = None  # and the entropy's (entropy_weights)
        self._cce_pending_mtp = []  # (depth, labels) of the MTP depths' calls, before the main head's
        self._cce_pending_log_probs = False  # and whether the main head's call returns log-probs
        self._cce_last_loss = None
        self._cce_last_entropy = None  # the entropy of a routed call that returned log-probs

    def reset_cce_state(self):
        """Forget what the backwards taught the loss and the paths it counted (UpstreamState.reset),
        the main head's and every MTP depth's: the next call takes the path its arguments choose,
        as in a fresh layer."""
        self.cce_state.reset()
        for state in self.mtp_cce_states.values():
            state.reset()

    # -----------------------------------------------------------------------------------------

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        return_log_probs: bool = False,
        entropy_weights: float | torch.Tensor | None = None,
    ):
        """With labels (or labels routed by ``use_cce``): (loss [b, s] fp32, None), times
        ``loss_weights`` [b, s] where given, plus ``entropy_weights`` times each token's entropy
        where given (``per_token_loss``); with ``return_log_probs`` ({"log_probs": [b, s],
        "entropy": [b, s]}, None) instead (``per_token_log_probs``). Without labels:
        ColumnParallelLinear's (logits, bias), honouring ``weight`` and ``runtime_gather_output``.

        A call routed with ``return_log_probs`` (GPTModel's, under ``route_labels``) returns the
        log-probs tensor alone in the logits' place, for megatron-core's code to hand on; the
        model's ``compute_language_model_loss`` makes the dict of it (``routed_output``)."""
        routed = labels is None and self._cce_pending_labels is not None
        if routed:
            twice = [name for name, given in (
                ("loss_weights", loss_weights is not None),
                ("entropy_weights", entropy_weights is not None),
                ("return_log_probs", return_log_probs),
            ) if given]
            if twice:
                raise ValueError(f"{twice[0]} was given twice: to the layer's forward and to route_labels")
            if self._cce_pending_mtp:  # an MTP depth's call (they come before the main head's)
                depth, depth_labels = self._cce_pending_mtp.pop(0)
                loss = self.per_token_loss(input_, depth_labels, weight, mtp_depth=depth)
                self._cce_last_loss = loss
                return loss, None
            labels, self._cce_pending_labels = self._cce_pending_labels, None
            loss_weights, self._cce_pending_weights = self._cce_pending_weights, None
            entropy_weights, self._cce_pending_entropy_weights = self._cce_pending_entropy_weights, None
            return_log_probs, self._cce_pending_log_probs = self._cce_pending_log_probs, False
        if not isinstance(return_log_probs, bool):
            raise TypeError(f"return_log_probs must be a bool, got {return_log_probs!r}")
        if labels is None:
            for name, w in (("loss_weights", loss_weights), ("entropy_weights", entropy_weights)):
                if w is not None:
                    raise ValueError(
                        f"{_WEIGHTS_DO[name]}; without labels the layer returns logits. Pass labels too"
                    )
            if return_log_probs:
                raise ValueError(
                    "return_log_probs returns the labels' log-probs; without labels the layer returns "
                    "logits. Pass labels too"
                )
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if return_log_probs:
            if loss_weights is not None or entropy_weights is not None:
                raise ValueError(_log_probs_and_weights(loss_weights))
            out = self.per_token_log_probs(input_, labels, weight)
            if routed:
                self._cce_last_loss, self._cce_last_entropy = out["log_probs"], out["entropy"]
                return out["log_probs"], None
            return out, None
        loss = self.per_token_loss(
            input_, labels, weight, loss_weights=loss_weights, entropy_weights=entropy_weights
        )
        if routed:
            self._cce_last_loss = loss
        return loss, None

    def per_token_log_probs(
        self, input_: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None
    ) -> dict:
        """{"log_probs": [b, s], "entropy": [b, s]}, both fp32 and differentiable, for hidden states
        [s(/tp), b, h] and labels [b, s]: each token's log-probability of its label and the entropy
        of its distribution over the whole (padded) vocabulary, at ``cce_options.temperature`` (and
        softcap). Both are 0 where the label is ``ignore_index``. Vocab-parallel: the statistics are
        all-reduced over the tensor-parallel group, never gathered; identical on every rank.

        log_probs is the negated per-token loss, so it needs a loss that is the cross-entropy alone:
        ``label_smoothing`` and ``z_loss`` must be 0 (ValueError). A backward through either output
        recomputes the gradients (exact; the lean path): the objective of an RL step is a function of
        them that the forward cannot know. Per-token weights known before the forward go into
        ``per_token_loss(..., loss_weights=..., entropy_weights=...)`` instead, whose gradients are
        made in the forward.
        """
        o = self.cce_options
        if o.label_smoothing or o.z_loss:
            raise ValueError(
                f"return_log_probs needs the per-token loss to be -log p(label) alone, but this layer's "
                f"options add to it (label_smoothing={o.label_smoothing}, z_loss={o.z_loss}); "
                "switch the model with label_smoothing=0 and z_loss=0 (use_cce) to get log-probs"
            )
        loss, entropy = self._cross_entropy(input_, labels, weight, return_entropy=True)
        return {"log_probs": -loss, "entropy": entropy}

    def routed_output(self, tensor):
        """What GPTModel returns for `tensor`, the output this layer returned under route_labels
        (``is_routed_loss``): the per-token loss itself, or with ``return_log_probs`` routed,
        {"log_probs": tensor, "entropy": the entropy of the same call}."""
        if self._cce_last_entropy is None:
            return tensor
        return {"log_probs": tensor, "entropy": self._cce_last_entropy}

    def per_token_loss(
        self,
        input_: torch.Tensor,
        labels: torch.Tensor,
        weight: torch.Tensor | None = None,
        *,
        loss_weights: torch.Tensor | None = None,
        entropy_weights: float | torch.Tensor | None = None,
        mtp_depth: int | None = None,
    ):
        """loss [b, s] fp32 for hidden states [s(/tp), b, h] and labels [b, s]; see the module doc.

        loss_weights: [b, s], any float dtype and sign, on the hidden states' device, or None. The
        loss is then loss_weights · cross-entropy per token (0 where labels equal ignore_index), and
        its gradients are made for that weighted loss in the forward: summed (or divided by one
        number) by the caller, the backward only scales them. A loss_weights tensor that requires
        grad gets the unweighted per-token loss as its gradient.

        entropy_weights: a finite number, or [b, s] like loss_weights, or None: each token's loss
        then gets entropy_weights · entropy added (its distribution's entropy over the whole padded
        vocabulary at ``cce_options.temperature``, 0 where the label is ignore_index), e.g. an RL
        entropy bonus, -coef / n over n response tokens; its gradients are made in the forward too
        (linear_cross_entropy's entropy_weights). A tensor that requires grad gets the entropy.

        mtp_depth: k in 1 .. mtp_num_layers for the loss of multi-token-prediction depth k: the
        call then uses that depth's state (``mtp_cce_states[k]``) and loss scale (module doc).

        Misuse raises ValueError / TypeError on every rank of the tensor-parallel group (the
        others learn of it in the loss's first collective), never a hang.
        """
        return self._cross_entropy(
            input_, labels, weight, loss_weights=loss_weights, entropy_weights=entropy_weights,
            mtp_depth=mtp_depth,
        )

    def _cross_entropy(
        self, input_, labels, weight, *, loss_weights=None, entropy_weights=None, mtp_depth=None,
        return_entropy=False,
    ):
        """per_token_loss; with return_entropy (per_token_log_probs) (loss, entropy), both [b, s],
        on the lean path: the objective of them is not known in the forward, so gradients made there
        would be recomputed in the backward anyway (linear_cross_entropy's return_entropy)."""
        tp = get_pg_size(self.tp_group)
        group = self.tp_group if tp > 1 else None
        sequence_parallel = bool(self.sequence_parallel) and tp > 1
        state, loss_kwargs = self.cce_state, self.cce_options.loss_kwargs()
        try:
            if mtp_depth is not None:
                if mtp_depth not in self.mtp_cce_states:
                    raise ValueError(
                        f"mtp_depth={mtp_depth!r}: this layer's config has mtp_num_layers="
                        f"{getattr(self.config, 'mtp_num_layers', None)}, depths {sorted(self.mtp_cce_states)}"
                    )
                state, loss_kwargs["loss_scale"] = self.mtp_cce_states[mtp_depth], self._mtp_loss_scale()
            if return_entropy:
                loss_kwargs["logits_budget"] = "lean"
            weight = self._resolve_weight(weight, tp)
            if any_dtensor(weight):
                # Its mesh would be taken for the vocabulary's; an FSDP shard is not a vocabulary shard.
                raise TypeError(
                    f"the output weight is a DTensor ({weight.placements} over {weight.device_mesh}): a parameter "
                    "FSDP sharded and did not gather for this forward (a tied embedding in an FSDP unit of its "
                    "own?); the layer needs this rank's whole tensor-parallel shard (keep a tied embedding in the "
                    "output layer's FSDP unit)"
                )
            self._check_labels(input_, labels, tp if sequence_parallel else 1)
            if loss_weights is not None:
                _check_token_weights("loss_weights", input_, labels, loss_weights)
            if entropy_weights is not None:
                _check_token_weights("entropy_weights", input_, labels, entropy_weights, number_ok=True)
            if self.bias is not None and self.skip_bias_add:
                raise ValueError(
                    "skip_bias_add returns the bias for the caller to add; a fused loss cannot do that"
                )
        except (TypeError, ValueError) as err:
            if group is not None:
                _fail_on_every_rank(err, input_, group, sequence_parallel)
            raise
        main_grad = None
        if (
            self.gradient_accumulation_fusion
            and hasattr(weight, "main_grad")
            and weight.requires_grad
            and torch.is_grad_enabled()
        ):
            if hasattr(weight, "__fsdp_param__"):
                # Megatron-FSDP hands out a fresh main-grad buffer per step (as Megatron's linear does).
                weight = _AccumulateIntoMainGrad.apply(weight)
            else:
                # The loss adds ∇W into main_grad in fp32; main_grad is read when the backward runs
                # (not saved), so later in-place updates of the buffer trip no version check.
                param = weight
                main_grad = lambda: param.main_grad  # noqa: E731
                weight = _MainGradHook.apply(weight)
        # [b, s] -> [s, b]: views of the labels and weights; the hidden states are never copied.
        out = linear_cross_entropy(
            input_,
            weight,
            labels.t(),
            bias=self.bias,
            reduction="none",
            weights=None if loss_weights is None else loss_weights.t(),
            entropy_weights=entropy_weights.t() if isinstance(entropy_weights, torch.Tensor)
            else entropy_weights,  # a number, or None
            state=state,
            **loss_kwargs,
            return_entropy=return_entropy,
            tp_group=group,
            sequence_parallel=sequence_parallel,
            main_grad=main_grad,
        )
        # [s, b] -> [b, s], contiguous as Megatron's compute_language_model_loss returns it.
        if return_entropy:
            return tuple(t.t().contiguous() for t in out)
        return out.t().contiguous()

    def _mtp_loss_scale(self) -> float | None:
        """What the schedule multiplies an MTP depth's loss by: megatron-core's MTP scales each
        depth's masked mean by mtp_loss_scaling_factor / mtp_num_layers (MTPLossAutoScaler) on top
        of the main loss's scale, CCEOptions.loss_scale. None (the depth's state learns it) where
        that option is not given, or with calculate_per_token_loss (no mean over the tokens)."""
        scale, config = self.cce_options.loss_scale, self.config
        if scale is None or getattr(config, "calculate_per_token_loss", False):
            return None
        scale *= config.mtp_loss_scaling_factor / config.mtp_num_layers
        return scale or None  # a factor of 0: no gradient to make, nothing to scale for

    def _resolve_weight(self, weight, tp: int):
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "this output layer has no weight of its own (skip_weight_param_allocation: tied "
                    "embeddings); pass weight= (the shared embedding weight)"
                )
            return self.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            hint = ""
            if tp > 1 and tuple(weight.shape) == (self.output_size, self.input_size):
                hint = " (it looks like the full, unsharded weight)"
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}{hint}, but this rank's shard of the "
                f"[{self.output_size}, {self.input_size}] output weight is {expected} (tp={tp})"
            )
        if tp > 1 and (
            getattr(weight, "tensor_model_parallel", True) is False
            or getattr(weight, "partition_dim", 0) not in (0, -2)
        ):
            attrs = {k: getattr(weight, k, None) for k in ("tensor_model_parallel", "partition_dim")}
            raise ValueError(
                f"weight is not a vocabulary shard ({attrs}); pass this rank's rows of the output / "
                "embedding weight, split along dim 0"
            )
        return weight

    def _check_labels(self, input_, labels, sp: int):
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
        if input_.dim() != 3:
            raise ValueError(f"hidden states must be [s, b, h], got shape {tuple(input_.shape)}")
        s, b = input_.shape[0] * sp, input_.shape[1]
        if tuple(labels.shape) != (b, s):
            layout = (
                f"[s/tp, b, h] = {tuple(input_.shape)} (sequence parallel, tp={sp})"
                if sp > 1
                else (f"[s, b, h] = {tuple(input_.shape)}")
            )
            hint = (
                " (they look like [s, b]; Megatron's labels are [b, s])"
                if tuple(labels.shape) == (s, b)
                else ""
            )
            got = tuple(labels.shape)
            raise ValueError(f"labels must be [b, s] = {(b, s)} for hidden states {layout}; got {got}{hint}")

    @contextlib.contextmanager
    def route_labels(
        self,
        labels: torch.Tensor,
        loss_weights: torch.Tensor | None = None,
        mtp_labels: list | tuple = (),
        return_log_probs: bool = False,
        entropy_weights: float | torch.Tensor | None = None,
    ):
        """Within the block, the next call without labels computes the loss with these labels (and
        these per-token weights [b, s] and entropy weights, where given), or with return_log_probs
        their log-probs and entropy (the call returns the log-probs tensor; ``routed_output`` makes
        the dict of it).

        mtp_labels: [l_1, ..., l_n], labels [b, s] of the multi-token-prediction depths 1 .. n,
        whose calls come first (GPTModel's order): the first n calls without labels compute depth
        k's loss with l_k (its state and scale, see the module doc), the next one the loss above.
        The block raises RuntimeError if it ends with a depth's labels, or the main head's after
        the depths', unused: megatron-core called the layer another way than it routes them.
        """
        if len(mtp_labels) > len(self.mtp_cce_states):
            raise ValueError(
                f"{len(mtp_labels)} MTP depths' labels for a layer with mtp_num_layers="
                f"{getattr(self.config, 'mtp_num_layers', None)}"
            )
        if return_log_probs and (loss_weights is not None or entropy_weights is not None or mtp_labels):
            raise ValueError(
                "return_log_probs with MTP depths' labels: a model with multi-token prediction "
                "returns its loss"
                if loss_weights is None and entropy_weights is None
                else _log_probs_and_weights(loss_weights)
            )
        self._cce_pending_labels, self._cce_pending_weights = labels, loss_weights
        self._cce_pending_entropy_weights = entropy_weights
        self._cce_pending_mtp = list(enumerate(mtp_labels, start=1))
        self._cce_pending_log_probs = bool(return_log_probs)
        self._cce_last_loss = self._cce_last_entropy = None
        try:
            yield
            if mtp_labels and (self._cce_pending_mtp or self._cce_pending_labels is not None):
                left = [f"mtp_{k}" for k, _ in self._cce_pending_mtp]
                left += ["the main head"] if self._cce_pending_labels is not None else []
                raise RuntimeError(
                    f"the output layer was called {len(mtp_labels) + 1 - len(left)} times without labels under "
                    f"route_labels, not {len(mtp_labels) + 1} (once per MTP depth, then the main head), so the "
                    f"labels of {', '.join(left)} went unused and the losses computed may have had another "
                    "call's labels; this megatron-core version's GPTModel._postprocess calls it another way"
                )
        finally:
            self._cce_pending_labels = self._cce_pending_weights = self._cce_pending_entropy_weights = None
            self._cce_pending_mtp = []
            self._cce_pending_log_probs = False
            self._cce_last_loss = self._cce_last_entropy = None

    def is_routed_loss(self, tensor) -> bool:
        """Whether `tensor` is the loss this layer returned in place of logits under route_labels,
        or a whole view of it (Megatron-FSDP's root forward hook returns outputs as ``view_as``)."""
        loss = self._cce_last_loss
        if tensor is None or loss is None:
            return False
        return tensor is loss or (
            isinstance(tensor, torch.Tensor)
            and tensor.untyped_storage().data_ptr() == loss.untyped_storage().data_ptr()
            and tensor.storage_offset() == loss.storage_offset()
            and tensor.shape == loss.shape
            # (strides of size-1 dimensions are arbitrary)
            and all(a == b for a, b, n in zip(tensor.stride(), loss.stride(), loss.shape) if n > 1)
        )

    def __repr__(self):
        mtp = f", mtp_cce_states={self.mtp_cce_states!r}" if self.mtp_cce_states else ""
        return super().__repr__()[:-1] + f", impl={self.cce_options.impl}, cce_state={self.cce_state!r}{mtp})"


_WEIGHTS_DO = {  # what each keyword does, for the errors
    "loss_weights": "loss_weights weight the per-token loss",
    "entropy_weights": "entropy_weights add each token's entropy to its loss",
}


def _log_probs_and_weights(loss_weights) -> str:
    """The error of return_log_probs with loss_weights or entropy_weights."""
    what = "loss_weights" if loss_weights is not None else "entropy_weights"
    return (
        f"return_log_probs and {what} together: {_WEIGHTS_DO[what]} (its gradients made in the forward), "
        "return_log_probs returns the unweighted log-probs for an objective computed from them; pass one "
        "or the other"
    )


def _check_token_weights(name: str, input_, labels, weights, number_ok: bool = False):
    """TypeError / ValueError unless `weights` (named `name` in the error) is a float tensor shaped
    like the labels [b, s], on the hidden states' device, or with number_ok a finite number (checked
    here, in Megatron's layout, rather than by the loss, which sees them transposed)."""
    if number_ok and _is_real(weights):
        if not math.isfinite(weights):
            raise ValueError(f"{name} must be finite, got {weights!r}")
        return
    if not isinstance(weights, torch.Tensor):
        what = "a finite number, a torch.Tensor" if number_ok else "a torch.Tensor"
        raise TypeError(f"{name} must be {what} or None, got {type(weights).__name__}")
    if not weights.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got dtype {weights.dtype} "
            "(a 0/1 mask: fold it into the labels with mask_labels, or pass it as float)"
        )
    if weights.shape != labels.shape:
        b, s = labels.shape
        hint = ""
        if tuple(weights.shape) == (s, b):
            hint = " (they look like [s, b]; Megatron's layout, as for the labels, is [b, s])"
        elif number_ok and weights.dim() == 0:
            hint = " (one number: pass it as a Python float)"
        raise ValueError(
            f"{name} must be shaped like the labels [b, s] = {(b, s)}; got {tuple(weights.shape)}{hint}"
        )
    if weights.device != input_.device:
        raise ValueError(f"{name} are on {weights.device}, but the hidden states are on {input_.device}")


def _fail_on_every_rank(err: Exception, input_, group, sequence_parallel: bool):
    """Raise `err` here after telling the rest of `group`, which are inside the loss's first
    collective (the layout check of ``linear_cross_entropy``), so that they raise too."""
    e = (
        input_
        if isinstance(input_, torch.Tensor) and input_.is_floating_point() and input_.dim() > 0
        else None
    )
    if e is None:
        e = torch.zeros(1, 1)
    # Targets of the wrong shape: rejected by the checks, reported to every rank, raised here.
    bad_targets = torch.empty(0, dtype=torch.long, device=e.device)
    try:
        linear_cross_entropy(
            e,
            e.new_zeros(1, e.shape[-1]),
            bad_targets,
            reduction="none",
            tp_group=group,
            sequence_parallel=sequence_parallel and e.dim() > 1,
        )
    except (TypeError, ValueError) as reported:
        raise err from reported
    raise err


_CLASSES = {ColumnParallelLinear: CCEOutputLayer}


def _cce_class(cls: type) -> type:
    """CCEOutputLayer, or a CCE subclass of a ColumnParallelLinear subclass (created once)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"CCE{cls.__name__}", (CCEOutputLayer, cls), {"__module__": __name__})
    return _CLASSES[cls]
