"""The GPT of a recipe: megatron-core's GPTModel with the CCE loss layer (or megatron's own).

    config = transformer_config(recipe, dtype=torch.bfloat16, cpu_init=False)
    model = build_gpt(recipe, config, vocab_size=padded)   # this rank's pipeline stage and TP shard

The layer spec is Transformer Engine's where TE is installed (and the run is on CUDA), otherwise
megatron-core's local layers with SDPA core attention and torch norms
(``cce_parallel.megatron.local_gpt_block_spec``), which run on CPU too. With ``loss.impl`` a CCE
impl, ``use_cce`` swaps the output layer so that ``model(tokens, position_ids, None, labels=labels)``
returns the per-token fp32 loss [b, s] without building logits; with ``megatron`` the model keeps
its ColumnParallelLinear + ``vocab_parallel_cross_entropy``, with ``megatron_fused`` the same
output layer + megatron-core's ``cross_entropy_loss_fusion`` (``cross_entropy_fusion_impl`` native
or te: ``loss_fusion_impl``). Needs parallel_state initialized.
"""

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import fast_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from cce_parallel.config import Recipe
from cce_parallel.megatron import local_gpt_block_spec, padded_vocab_size, use_cce
from cce_parallel.megatron.rotary import use_local_rotary


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def have_grad_accumulation_fusion() -> bool:
    """apex's CUDA extension that megatron's linear layers need for gradient_accumulation_fusion."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def grad_accumulation_fusion(recipe: Recipe, *, cpu_init: bool) -> bool:
    """Whether the job's linear layers (and the CCE output layer) add weight gradients into an fp32
    main_grad: apex's extension installed, GPU initialization, and no FSDP (FSDP2 gives its
    parameters no main_grad buffer; megatron-core 0.19's Megatron-FSDP allows the fusion only with
    Transformer Engine >= 2.10, and with a tied embedding the fused path would drop the lookup's
    gradient, as Megatron-FSDP ignores zero_out_wgrad)."""
    return have_grad_accumulation_fusion() and not cpu_init and recipe.parallel.fsdp == "none"


def model_vocab_size(recipe: Recipe, tokenizer_vocab: int) -> int:
    """The padded vocabulary of the model: model.vocab_size (or the tokenizer's), rounded up to a
    multiple of make_vocab_size_divisible_by · tp, as Megatron-LM pads it."""
    m = recipe.model
    vocab = m.vocab_size if m.vocab_size is not None else tokenizer_vocab
    if vocab < tokenizer_vocab:
        from cce_parallel.config import RecipeError

        raise RecipeError(
            f"model.vocab_size: {vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab} tokens)"
        )
    return padded_vocab_size(vocab, m.make_vocab_size_divisible_by, recipe.parallel.tensor)


def loss_fusion_impl(recipe: Recipe) -> str | None:
    """megatron-core's ``cross_entropy_fusion_impl`` for ``loss.impl=megatron_fused`` (None for the
    other impls): ``loss.fusion_impl``, where ``auto`` is te with Transformer Engine installed and
    CUDA available (its kernel is Triton on the GPU), else native (torch.compile'd, CPU too)."""
    loss = recipe.loss
    if loss.impl != "megatron_fused":
        return None
    if loss.fusion_impl == "auto":
        return "te" if have_te() and torch.cuda.is_available() else "native"
    if loss.fusion_impl == "te" and not have_te():
        from cce_parallel.config import RecipeError

        # megatron-core would only fail at the first loss ("Trying to use a TE block when it's not present").
        raise RecipeError("loss.fusion_impl: te, but Transformer Engine is not installed (use auto or native)")
    return loss.fusion_impl


def transformer_config(recipe: Recipe, *, dtype: torch.dtype, cpu_init: bool, init: bool = True) -> TransformerConfig:
    """megatron-core's TransformerConfig for the recipe (no fusions that need apex or TE kernels,
    except the loss fusion that ``loss.impl=megatron_fused`` asks for)."""
    m, p = recipe.model, recipe.parallel
    fusion = loss_fusion_impl(recipe)
    activation, gated = {"gelu": (F.gelu, False), "swiglu": (F.silu, True), "geglu": (fast_gelu, True)}[m.activation]
    half = dtype != torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.ffn_size,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        sequence_parallel=p.sequence_parallel,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.layernorm_epsilon,
        normalization=m.normalization,
        add_bias_linear=m.add_bias_linear,
        gated_linear_unit=gated,
        activation_func=activation,
        bf16=half and dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype if p.pipeline > 1 else None,
        # Per-rank initialization draws a full master weight and keeps this rank's shard, so the
        # model does not depend on the TP layout (used on CPU; GPUs draw each shard on the device).
        use_cpu_initialization=cpu_init,
        perform_initialization=init,
        # Fusions: apex kernels for the weight-gradient accumulation, TE/jit ones for the rest.
        gradient_accumulation_fusion=grad_accumulation_fusion(recipe, cpu_init=cpu_init),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        # megatron_fused: GPTModel.compute_language_model_loss takes megatron-core's fused loss.
        cross_entropy_loss_fusion=fusion is not None,
        cross_entropy_fusion_impl=fusion or "native",
        deallocate_pipeline_outputs=p.pipeline > 1,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        recompute_modules=m.recompute_module_list if m.recompute_granularity == "selective" else None,
        # Megatron's own switch: Transformer Engine's deterministic kernels, no nondeterministic fusions.
        deterministic_mode=recipe.train.deterministic,
        layernorm_zero_centered_gamma=m.zero_centered_norm,
        # Multi-token prediction (DeepSeek-V3): its layers sit on the last pipeline stage.
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
    )


def use_te(recipe: Recipe, device: str) -> bool:
    """Transformer Engine layers: model.attention te, or auto on CUDA with TE installed and no
    Gemma 2 option (those need the local spec)."""
    attention = recipe.model.attention
    auto = attention == "auto" and device == "cuda" and have_te() and not recipe.model.gemma2_options
    return attention == "te" or auto


def layer_spec(recipe: Recipe, config: TransformerConfig, device: str):
    if recipe.model.attention == "te" and not have_te():
        from cce_parallel.config import RecipeError

        raise RecipeError("model.attention: te, but Transformer Engine is not installed (use auto or sdpa)")
    if use_te(recipe, device):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    m = recipe.model
    gemma2 = {"attention_softcap": m.attention_softcap, "sliding_window": m.sliding_window, "post_norms": m.post_norms}
    # A block spec, so that the final norm is a LocalNorm too. From a layer spec megatron-core
    # builds its own final norm: apex's FusedLayerNorm where apex is installed, which refuses
    # RMSNorm; WrappedTorchNorm otherwise, which refuses sequence parallelism and zero-centered weights.
    return local_gpt_block_spec(config, **gemma2)


def mtp_block_spec(config: TransformerConfig, spec, *, use_te: bool):
    """megatron-core's multi-token-prediction block spec for the layer or block spec `spec` (each
    MTP layer is its last transformer layer between megatron-core's MTP norms and projection), or
    None where this rank builds no MTP layer (no config.mtp_num_layers, or not the last stage).
    Without Transformer Engine the MTP norms are ``LocalNorm``s, as in the local spec (megatron-core's
    local norm refuses sequence parallelism)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from cce_parallel.megatron import LocalNorm

    if not config.mtp_num_layers:
        return None
    block = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te)
    if block is None or use_te:
        return block
    layers = []
    for layer in block.layer_specs:
        norms = dataclasses.replace(layer.submodules, enorm=LocalNorm, hnorm=LocalNorm, layer_norm=LocalNorm)
        layers.append(dataclasses.replace(layer, submodules=norms))
    return dataclasses.replace(block, layer_specs=layers)


def build_gpt(
    recipe: Recipe, config: TransformerConfig, *, vocab_size: int, device: str,
    loss_scale: float | None = None,
) -> GPTModel:
    """This rank's GPTModel stage (pre/post-process by pipeline stage), with the recipe's loss layer
    and, with model.mtp_num_layers, megatron-core's multi-token-prediction layers on the last stage.
    loss_scale: what the schedule multiplies each micro-batch's loss by (1 / micro-batches), for
    the CCE layer (CCEOptions.loss_scale)."""
    m, loss = recipe.model, recipe.loss
    spec = layer_spec(recipe, config, device)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type=m.position_embedding,
        rotary_base=m.rotary_base,
        rope_scaling=m.rope_scaling_factor is not None,
        rope_scaling_factor=m.rope_scaling_factor or 8.0,  # megatron's default, unused without scaling
        mtp_block_spec=mtp_block_spec(config, spec, use_te=use_te(recipe, device)),
    )
    use_local_rotary(model)  # RoPE's frequencies stay on the model's device (CPU runs too)
    if m.scale_embeddings and model.pre_process:
        model.embedding.register_forward_hook(_scale_by_sqrt_hidden)
    if loss.is_cce:
        use_cce(
            model,
            impl=loss.impl,
            softcap=loss.softcap,
            label_smoothing=loss.label_smoothing,
            z_loss=loss.z_loss,
            logits_budget=loss.logits_budget,
            loss_scale=loss_scale,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        )
    return model


def _scale_by_sqrt_hidden(module, inputs, output):
    """Gemma's input embedding scaling: embeddings · sqrt(h), the factor rounded to their dtype."""
    return output * torch.tensor(output.shape[-1] ** 0.5, dtype=output.dtype)


# -- sizes ---------------------------------------------------------------------------------------


def count_parameters(model: torch.nn.Module, tp: int) -> tuple[int, int]:
    """(parameters on this rank, parameters of this stage over its TP group)."""
    local = sum(p.numel() for p in model.parameters())
    over_tp = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters())
    return local, over_tp


def flops_per_token(recipe: Recipe, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward): 6 per weight of every matmul, the output
    layer included, plus the attention scores and values 12 · layers · seq · head_dim · heads
    (not halved for causality, as Megatron-LM and PaLM count). Each multi-token-prediction depth
    adds a layer, its [2h -> h] projection and another pass through the output layer."""
    m = recipe.model
    h, heads, groups, d = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    attention = h * heads * d + 2 * h * groups * d + heads * d * h
    mlp = h * m.ffn_size * (3 if m.activation in ("swiglu", "geglu") else 2)
    mtp = m.mtp_num_layers or 0
    layers = m.num_layers + mtp
    matmul_weights = layers * (attention + mlp) + mtp * 2 * h * h + (1 + mtp) * vocab_size * h
    return 6.0 * matmul_weights + 12.0 * layers * m.seq_length * heads * d
