"""A megatron-core GPT layer spec with no Transformer Engine and no apex that runs on CPU and GPUs.

megatron-core's own local spec (``get_gpt_layer_local_spec``) falls short without apex: its
``DotProductAttention`` builds the causal mask on CUDA only, and ``WrappedTorchNorm`` refuses
sequence parallelism. This spec swaps in:

- ``SDPAttention`` (attention.py) for the core attention;
- ``LocalNorm``: torch's LayerNorm / RMSNorm (``config.normalization``) whose parameters carry
  ``sequence_parallel = config.sequence_parallel``, the attribute Megatron's
  ``finalize_model_grads`` reads to all-reduce their gradients over the tensor-parallel group
  (each rank saw only its [s/tp, b, h] slice), as apex's ``FusedLayerNorm`` does. With
  ``config.layernorm_zero_centered_gamma`` it is a ``ZeroCenteredNorm``: weights w initialized to
  0 and applied as (1 + w), Gemma's RMSNorm, math in fp32.

Everything else (column/row-parallel linears, MLP, bias-dropout-add) is megatron-core's own.
The transformer block's final norm is not part of a layer spec; ``local_gpt_block_spec`` gives a
block spec that includes it, which sequence parallelism needs.

Gemma 2's layer is this spec with three options of ``local_gpt_layer_spec``:
``attention_softcap=50`` and ``sliding_window=4096`` (SDPAttention's, see attention.py: the
window on layers 1, 3, 5, ... counted from 1, as Gemma 2 alternates them) and ``post_norms=True``:
the "sandwich" norms, a LocalNorm on the attention output and one on the MLP output, before each
residual add (``PostNormSelfAttention``, ``PostNormMLP``; state-dict keys
``self_attention.post_norm.*`` and ``mlp.post_norm.*``).
"""

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from cce_parallel.megatron.attention import SDPAttention

try:  # apex's norm, where megatron-core found apex
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
except ImportError:  # pragma: no cover - megatron-core always has the module
    FusedLayerNorm = None


class LocalNorm:
    """Builds torch's LayerNorm or RMSNorm (per ``config.normalization``) for a layer spec.

    Called by megatron-core as ``LocalNorm(config=..., hidden_size=..., eps=...)``; returns a
    plain ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` whose parameters are tagged
    ``sequence_parallel`` so that Megatron all-reduces their gradients under sequence parallelism.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"LocalNorm supports normalization LayerNorm or RMSNorm, got {config.normalization!r}"
            )
        # Like WrappedTorchNorm and apex's FusedLayerNorm: fp32 on the default device; the model's
        # wrappers (.cuda(), Float16Module) move and cast it.
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            norm = ZeroCenteredNorm(hidden_size, eps=eps, kind=config.normalization)
        else:
            norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredNorm(torch.nn.Module):
    """(1 + w) · norm(x) (+ b for LayerNorm), w initialized to 0: Gemma's RMSNorm, which computes
    in fp32 and casts the result to the input's dtype. x [..., h] -> [..., h]."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, kind: str = "RMSNorm"):
        super().__init__()
        self.kind, self.eps, self.shape = kind, eps, (hidden_size,)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if kind == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = _compiled_zero_centered() if x.is_cuda else _zero_centered
        return norm(x, self.weight, self.bias, self.shape, self.eps, self.kind == "RMSNorm")


def _zero_centered(x, weight, bias, shape: tuple, eps: float, rms: bool) -> torch.Tensor:
    x32 = x.float()
    y = F.rms_norm(x32, shape, eps=eps) if rms else F.layer_norm(x32, shape, eps=eps)
    y = y * (1.0 + weight.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.cache
def _compiled_zero_centered():
    """On CUDA one fused kernel each way, saving x rather than fp32 copies of it: eager, Gemma 2's
    four norms per layer made the recipe's step slower and its memory larger (see docs/training.md)."""
    return torch.compile(_zero_centered, dynamic=False)


class _PostNorm:
    """A module whose (output, bias) gets a LocalNorm on output + bias before the residual add."""

    def _build_post_norm(self, config: TransformerConfig):
        self.post_norm = LocalNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    def _post_norm(self, result):
        output, bias = result
        if bias is not None:
            output = output + bias
        return self.post_norm(output), None


class PostNormSelfAttention(_PostNorm, SelfAttention):
    """megatron-core's SelfAttention followed by a norm (Gemma 2's post-attention norm)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._build_post_norm(config)

    def forward(self, *args, **kwargs):
        return self._post_norm(super().forward(*args, **kwargs))


class PostNormMLP(_PostNorm, MLP):
    """megatron-core's MLP followed by a norm (Gemma 2's post-feedforward norm)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._build_post_norm(config)

    def forward(self, *args, **kwargs):
        return self._post_norm(super().forward(*args, **kwargs))


def _replace_modules(spec, mapping: dict):
    """Copy of a (nested) spec with every module class in `mapping` replaced by its value."""
    if isinstance(spec, type):
        return mapping.get(spec, spec)
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec,
            module=mapping.get(spec.module, spec.module) if isinstance(spec.module, type) else spec.module,
            submodules=_replace_modules(spec.submodules, mapping),
        )
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: _replace_modules(getattr(spec, f.name), mapping)
            for f in dataclasses.fields(spec)
            if isinstance(getattr(spec, f.name), (type, ModuleSpec))
            or dataclasses.is_dataclass(getattr(spec, f.name))
        }
        return dataclasses.replace(spec, **changes)
    return spec


def _local_modules() -> dict:
    mapping = {DotProductAttention: SDPAttention, WrappedTorchNorm: LocalNorm}
    if FusedLayerNorm is not None:
        mapping[FusedLayerNorm] = LocalNorm
    return mapping


def _post_norm_mlp(mlp):
    """The layer spec's MLP entry with PostNormMLP for MLP: a ModuleSpec (megatron-core 0.16), or
    a functools.partial of ``MLP.as_mlp_submodule`` (0.19)."""
    if isinstance(mlp, ModuleSpec) and mlp.module is MLP:
        return dataclasses.replace(mlp, module=PostNormMLP)
    if isinstance(mlp, functools.partial) and getattr(mlp.func, "__self__", None) is MLP:
        return functools.partial(getattr(PostNormMLP, mlp.func.__name__), *mlp.args, **mlp.keywords)
    raise TypeError(f"post_norms: the layer spec's MLP is neither megatron-core's dense MLP spec nor its builder: {mlp!r}")


def local_gpt_layer_spec(
    *, attention_softcap: float | None = None, sliding_window: int | None = None, post_norms: bool = False, **kwargs
) -> ModuleSpec:
    """megatron-core's ``get_gpt_layer_local_spec(**kwargs)`` with SDPAttention and LocalNorm.

    attention_softcap, sliding_window: SDPAttention's softcap and sliding_window (Gemma 2: 50, 4096).
    post_norms: a norm after the attention and after the MLP (Gemma 2's sandwich norms).
    kwargs go to ``get_gpt_layer_local_spec`` (e.g. ``qk_layernorm=True``, ``num_experts=8``).
    Pass the result as GPTModel's ``transformer_layer_spec`` when sequence parallelism is off;
    with it on, use ``local_gpt_block_spec`` (the final norm is part of the block, not the layer).
    """
    spec = _replace_modules(get_gpt_layer_local_spec(**kwargs), _local_modules())
    attention = spec.submodules.self_attention
    core = ModuleSpec(module=SDPAttention, params={"softcap": attention_softcap, "sliding_window": sliding_window})
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, core_attention=core))
    mlp = spec.submodules.mlp
    if post_norms:
        attention = dataclasses.replace(attention, module=PostNormSelfAttention)
        mlp = _post_norm_mlp(mlp)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention, mlp=mlp))


def local_gpt_block_spec(
    config: TransformerConfig, *, vp_stage=None, pp_rank=None, **kwargs
) -> TransformerBlockSubmodules:
    """A transformer-block spec: this pipeline stage's layers (``local_gpt_layer_spec(**kwargs)``)
    and a LocalNorm final norm. Pass it as GPTModel's ``transformer_layer_spec``.

    vp_stage / pp_rank: as megatron-core's ``get_num_layers_to_build`` (default: this rank's stage).
    """
    layer = local_gpt_layer_spec(**kwargs)
    n_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n_layers, layer_norm=LocalNorm)
