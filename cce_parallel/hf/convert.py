"""Weights between our megatron-core GPTModel and Hugging Face transformers, tensor by tensor.

Three architectures, chosen from the recipe's model section (``architecture``):

    gpt2    GPT2LMHeadModel      learned positions, LayerNorm, GeLU (exact: activation_function
                                 "gelu"), biases, heads · head_dim = hidden, no GQA
    llama   LlamaForCausalLM     RoPE (Llama 3 scaling), RMSNorm, SwiGLU, GQA, tied or not
    gemma2  Gemma2ForCausalLM    the Llama shape with GeGLU (tanh), embeddings · sqrt(h), (1 + w)
                                 norms, post-attention / post-MLP norms, attention softcap,
                                 sliding window on every other layer, final-logit softcap

A parameter of ours is named as in a TP=1, PP=1 model with global layer indices (``canonical``:
``decoder.layers.{g}.…``) and has one of these tensor-parallel layouts (Megatron's):

    vocab       rows split over tp, the vocabulary padded to V (embedding, output layer)
    column      rows split (GPT-2's fc1)
    row         columns split (attention output, fc2)
    qkv         rows split by query group, each group's rows [its q heads, k, v] (linear_qkv)
    gated       rows split; each rank holds [its gate rows; its up rows] (fc1 of SwiGLU/GeGLU)
    replicated  norms, position table, biases of row-parallel layers

``Source`` views: where a parameter comes from in the HF state dict, as rows of a tensor in
Megatron's [out, in] orientation (GPT-2's Conv1D weights are stored [in, out]: ``transpose``).
``local_shard`` reads only this rank's rows from an HF reader (safetensors slices: a rank never
holds the whole model); ``merge_shards`` and ``hf_tensors`` go the other way, for the export.
This module imports torch only.
"""

import dataclasses
import re

import torch

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
LLAMA3_ORIGINAL_CONTEXT = 8192  # megatron-core's Llama 3 scaling: low/high frequency factors 1 and 4


class ConversionError(ValueError):
    """The model cannot be converted; the message names the recipe key or file at fault."""


# -- the architecture of a recipe ----------------------------------------------------------------


def _mismatch(arch: str, m, loss) -> str | None:
    """The first recipe setting that `arch` cannot express, as 'model.key: ...', or None."""
    pos, norm, act = m.position_embedding, m.normalization, m.activation
    gemma = m.gemma2_options
    want = {
        "gpt2": [("position_embedding", pos == "learned_absolute", "learned_absolute"),
                 ("normalization", norm == "LayerNorm", "LayerNorm"), ("activation", act == "gelu", "gelu"),
                 ("add_bias_linear", m.add_bias_linear, "true"),
                 ("num_query_groups", m.query_groups == m.num_attention_heads, "null (no GQA)"),
                 ("kv_channels", m.head_dim * m.num_attention_heads == m.hidden_size, "hidden_size / heads")],
        "llama": [("position_embedding", pos == "rope", "rope"), ("normalization", norm == "RMSNorm", "RMSNorm"),
                  ("activation", act == "swiglu", "swiglu")],
        "gemma2": [("position_embedding", pos == "rope", "rope"), ("normalization", norm == "RMSNorm", "RMSNorm"),
                   ("activation", act == "geglu", "geglu"), ("add_bias_linear", not m.add_bias_linear, "false"),
                   ("scale_embeddings", m.scale_embeddings, "true"), ("post_norms", m.post_norms, "true"),
                   ("zero_centered_norm", m.zero_centered_norm, "true"),
                   ("rope_scaling_factor", m.rope_scaling_factor is None, "null")],
    }[arch]
    if arch != "gemma2":
        want += [(name, False, "unset (a Gemma 2 option)") for name in gemma]
        want += [("scale_embeddings", not m.scale_embeddings, "false")]
    for name, ok, expected in want:
        if not ok:
            return f"model.{name}: {getattr(m, name)!r}; a {ARCHITECTURES[arch]} needs {expected}"
    if arch != "gemma2" and loss.softcap is not None:
        return f"loss.softcap: {loss.softcap}; only Gemma 2 has a final-logit softcap"
    return None


def architecture(recipe) -> str:
    """gpt2, llama or gemma2 for the recipe's model; ConversionError naming the first option that
    none of them has (the family guessed from model.activation)."""
    m = recipe.model
    guess = {"gelu": "gpt2", "swiglu": "llama", "geglu": "gemma2"}[m.activation]
    if m.gemma2_options or m.scale_embeddings:
        guess = "gemma2"
    problem = _mismatch(guess, m, recipe.loss)
    if problem:
        raise ConversionError(
            f"{problem}. Hugging Face conversion supports GPT-2 (learned positions, LayerNorm, gelu, biases), "
            "Llama (rope, RMSNorm, swiglu) and Gemma 2 (rope, RMSNorm, geglu, model.post_norms, "
            "model.zero_centered_norm, model.scale_embeddings) models"
        )
    return guess


def hf_config(recipe, vocab_size: int, *, eos_token_id: int | None = None) -> dict:
    """The transformers config (``model_type`` and its fields) of the recipe's model."""
    m, arch = recipe.model, architecture(recipe)
    common = {"vocab_size": vocab_size, "tie_word_embeddings": m.tie_embeddings}
    if eos_token_id is not None:
        common.update(eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    if arch == "gpt2":
        return dict(common, model_type="gpt2", architectures=[ARCHITECTURES[arch]],
                    n_positions=m.max_position_embeddings or m.seq_length, n_embd=m.hidden_size,
                    n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_size,
                    activation_function="gelu", layer_norm_epsilon=m.layernorm_epsilon,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    positions = m.seq_length
    if m.rope_scaling_factor is not None:
        rope.update(rope_type="llama3", factor=float(m.rope_scaling_factor), low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT)
        positions = max(positions, 16 * LLAMA3_ORIGINAL_CONTEXT)  # Llama 3.1 / 3.2's 131,072
    shared = dict(common, architectures=[ARCHITECTURES[arch]], hidden_size=m.hidden_size,
                  intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_attention_heads, num_key_value_heads=m.query_groups,
                  head_dim=m.head_dim, rms_norm_eps=m.layernorm_epsilon, max_position_embeddings=positions,
                  rope_parameters=rope, attention_dropout=0.0)
    if arch == "llama":
        return dict(shared, model_type="llama", hidden_act="silu", attention_bias=m.add_bias_linear,
                    mlp_bias=m.add_bias_linear)
    window = m.sliding_window
    layer_types = ["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(m.num_layers)]
    return dict(shared, model_type="gemma2", hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                query_pre_attn_scalar=m.head_dim, sliding_window=window, layer_types=layer_types,
                attn_logit_softcapping=m.attention_softcap, final_logit_softcapping=recipe.loss.softcap)


# Recipe key -> HF config field, in the order a size check reports them.
_CHECKED = {
    "gpt2": [("num_layers", "n_layer"), ("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
             ("ffn_hidden_size", "n_inner"), ("max_position_embeddings", "n_positions"),
             ("layernorm_epsilon", "layer_norm_epsilon"), ("tie_embeddings", "tie_word_embeddings")],
    "llama": [("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
              ("num_attention_heads", "num_attention_heads"), ("num_query_groups", "num_key_value_heads"),
              ("kv_channels", "head_dim"), ("ffn_hidden_size", "intermediate_size"),
              ("layernorm_epsilon", "rms_norm_eps"), ("add_bias_linear", "attention_bias"),
              ("add_bias_linear", "mlp_bias"), ("tie_embeddings", "tie_word_embeddings")],
}
_CHECKED["gemma2"] = _CHECKED["llama"][:7] + [
    ("tie_embeddings", "tie_word_embeddings"), ("attention_softcap", "attn_logit_softcapping"),
    ("sliding_window", "sliding_window"), ("kv_channels", "query_pre_attn_scalar"),
]


def check_config(recipe, config: dict, *, where: str, vocab: tuple[int, int]):
    """Raise ConversionError naming the first difference between the recipe's model and a
    transformers config.json (dict); vocab: (the least, the most) vocabulary rows the model takes."""
    arch = architecture(recipe)
    if config.get("model_type") != arch:
        raise ConversionError(
            f"model.init_from: {where} holds a {config.get('model_type')!r} model; the recipe's model is {arch} "
            f"({ARCHITECTURES[arch]})"
        )
    ours = hf_config(recipe, config.get("vocab_size", 0))
    if arch == "gemma2" and (config.get("layer_types") or [None])[0] != "sliding_attention":
        config = dict(config, sliding_window=None)  # every layer global
    for key, field in _CHECKED[arch]:
        theirs, mine = config.get(field), ours.get(field)
        if field == "tie_word_embeddings" and theirs is None:
            theirs = True  # transformers' default
        if field == "head_dim" and theirs is None:
            theirs = config["hidden_size"] // config["num_attention_heads"]
        if field == "n_inner" and theirs is None:
            theirs = 4 * config["n_embd"]
        if isinstance(mine, float) or isinstance(theirs, float):
            same = theirs is not None and mine is not None and abs(float(theirs) - float(mine)) <= 1e-12
        else:
            same = theirs == mine
        if not same:
            raise ConversionError(
                f"model.{key}: the recipe gives {field}={mine!r}, {where} has {field}={theirs!r}"
            )
    if arch != "gpt2":
        rope = _rope(config)
        if rope != ours["rope_parameters"]:
            raise ConversionError(
                f"model.rotary_base / model.rope_scaling_factor: the recipe gives RoPE {ours['rope_parameters']}, "
                f"{where} has {rope}"
            )
    if arch == "gemma2" and config.get("final_logit_softcapping") != recipe.loss.softcap:
        raise ConversionError(
            f"loss.softcap: the recipe gives {recipe.loss.softcap}, {where} has final_logit_softcapping="
            f"{config.get('final_logit_softcapping')}"
        )
    least, most = vocab
    if not least <= config.get("vocab_size", -1) <= most:
        raise ConversionError(
            f"model.vocab_size: {where} has vocab_size={config.get('vocab_size')}; the recipe's model takes "
            f"{least} (its vocabulary) to {most} (padded) rows"
        )


def _rope(config: dict) -> dict:
    """RoPE parameters of a config.json, transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling)."""
    if config.get("rope_parameters"):
        rope = dict(config["rope_parameters"])
    else:
        rope = dict(config.get("rope_scaling") or {"rope_type": "default"})
        rope["rope_theta"] = config.get("rope_theta", 10000.0)
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
    keep = {"rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    return {k: float(v) if isinstance(v, int) else v for k, v in rope.items() if k in keep}


# -- parameters ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """Rows [start, stop) (None: all) of HF tensor `key` in Megatron's [out, in] orientation."""

    key: str
    start: int | None = None
    stop: int | None = None
    transpose: bool = False  # stored [in, out] (GPT-2's Conv1D)


@dataclasses.dataclass(frozen=True)
class Param:
    """A canonical parameter of ours: its tensor-parallel layout and its HF sources (by role:
    q, k, v for qkv; gate, up for gated; one source otherwise)."""

    layout: str
    sources: tuple[Source, ...]
    split: int = 0  # column / row layouts: the full size of the split dimension


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes that the layouts need."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int  # the model's padded vocabulary V
    hf_vocab: int  # rows of the HF embedding / output (<= V)


def shape_of(recipe, vocab: int, hf_vocab: int) -> Shape:
    m = recipe.model
    return Shape(m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim, m.ffn_size, vocab, hf_vocab)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Transformer Engine's layers fuse the pre-norms into the next linear layer.
_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def canonical_name(name: str, layer_offset: int = 0) -> str | None:
    """Our state-dict name as a TP=1 PP=1 model names it (global layer index, no wrapper prefix,
    TE's fused norms under the local spec's names); None for entries that are not weights."""
    while name.startswith("module."):
        name = name[len("module."):]
    if name.endswith("_extra_state"):
        return None
    match = _LAYER.match(name)
    if match:
        rest = _TE_NAMES.get(match.group(2), match.group(2))
        return f"decoder.layers.{int(match.group(1)) + layer_offset}.{rest}"
    return name


def param(arch: str, name: str, s: Shape, *, tied: bool) -> Param:
    """The layout and HF sources of canonical parameter `name`; ConversionError if unknown."""
    h, attn = s.hidden, s.heads * s.head_dim
    gpt2 = arch == "gpt2"
    embed = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
    if name == "embedding.word_embeddings.weight":
        return Param("vocab", (Source(embed),))
    if name == "output_layer.weight":
        return Param("vocab", (Source(embed if tied else "lm_head.weight"),))
    if name == "embedding.position_embeddings.weight" and gpt2:
        return Param("replicated", (Source("transformer.wpe.weight"),))
    if name.startswith("decoder.final_layernorm."):
        prefix = "transformer.ln_f." if gpt2 else "model.norm."
        return Param("replicated", (Source(prefix + name.rsplit(".", 1)[1]),))
    match = _LAYER.match(name)
    if not match:
        raise ConversionError(f"{name}: no Hugging Face counterpart in a {ARCHITECTURES[arch]}")
    g, rest = int(match.group(1)), match.group(2)
    part, kind = rest.rsplit(".", 1)  # kind: weight or bias
    if gpt2:
        hf = f"transformer.h.{g}."
        table = {
            "input_layernorm": ("replicated", [f"{hf}ln_1.{kind}"]),
            "pre_mlp_layernorm": ("replicated", [f"{hf}ln_2.{kind}"]),
            "self_attention.linear_qkv": ("qkv", [(f"{hf}attn.c_attn.{kind}", a, b) for a, b in
                                                  ((0, h), (h, 2 * h), (2 * h, 3 * h))]),
            "self_attention.linear_proj": ("row" if kind == "weight" else "replicated", [f"{hf}attn.c_proj.{kind}"]),
            "mlp.linear_fc1": ("column", [f"{hf}mlp.c_fc.{kind}"]),
            "mlp.linear_fc2": ("row" if kind == "weight" else "replicated", [f"{hf}mlp.c_proj.{kind}"]),
        }
    else:
        hf = f"model.layers.{g}."
        table = {
            "input_layernorm": ("replicated", [f"{hf}input_layernorm.{kind}"]),
            "self_attention.linear_qkv": ("qkv", [f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"]),
            "self_attention.linear_proj": ("row" if kind == "weight" else "replicated", [f"{hf}self_attn.o_proj.{kind}"]),
            "mlp.linear_fc1": ("gated", [f"{hf}mlp.gate_proj.{kind}", f"{hf}mlp.up_proj.{kind}"]),
            "mlp.linear_fc2": ("row" if kind == "weight" else "replicated", [f"{hf}mlp.down_proj.{kind}"]),
        }
        if arch == "llama":
            table["pre_mlp_layernorm"] = ("replicated", [f"{hf}post_attention_layernorm.{kind}"])
        else:
            table["self_attention.post_norm"] = ("replicated", [f"{hf}post_attention_layernorm.{kind}"])
            table["pre_mlp_layernorm"] = ("replicated", [f"{hf}pre_feedforward_layernorm.{kind}"])
            table["mlp.post_norm"] = ("replicated", [f"{hf}post_feedforward_layernorm.{kind}"])
    if part not in table:
        raise ConversionError(f"{name}: no Hugging Face counterpart in a {ARCHITECTURES[arch]}")
    layout, keys = table[part]
    # GPT-2's Conv1D weights are [in, out]; its c_attn packs q, k, v side by side (rows a:b of ours).
    transpose = gpt2 and kind == "weight" and "layernorm" not in part
    sources = tuple(
        Source(k[0], k[1], k[2], transpose) if isinstance(k, tuple) else Source(k, transpose=transpose) for k in keys
    )
    split = {"row": s.ffn if part == "mlp.linear_fc2" else attn, "column": s.ffn}.get(layout, 0)
    return Param(layout, sources, split)


# -- HF -> this rank's shard ---------------------------------------------------------------------


def local_shard(p: Param, s: Shape, read, rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of parameter p. read(source, start, stop, dim) returns rows [start, stop)
    (or, dim=1, columns) of the source in Megatron's orientation; None bounds: all."""
    if p.layout == "replicated":
        return read(p.sources[0], None, None, 0)
    if p.layout == "vocab":
        per = s.vocab // tp
        start, stop = rank * per, (rank + 1) * per
        got = read(p.sources[0], start, min(stop, s.hf_vocab), 0) if start < s.hf_vocab else None
        pad = per - (0 if got is None else got.shape[0])
        if pad == 0:
            return got
        # Rows past the HF vocabulary (padding): zeros, i.e. logits 0 (see docs/training.md, "Hugging Face in and out").
        filler = torch.zeros((pad, s.hidden), dtype=torch.float32 if got is None else got.dtype)
        return filler if got is None else torch.cat([got, filler])
    if p.layout == "column":
        return read(p.sources[0], rank * p.split // tp, (rank + 1) * p.split // tp, 0)
    if p.layout == "row":
        return read(p.sources[0], None, None, 1, rank * p.split // tp, (rank + 1) * p.split // tp)
    if p.layout == "gated":
        start, stop = rank * s.ffn // tp, (rank + 1) * s.ffn // tp
        return torch.cat([read(src, start, stop, 0) for src in p.sources])
    if p.layout == "qkv":
        d, per_group = s.head_dim, s.heads // s.groups
        g0, g1 = rank * s.groups // tp, (rank + 1) * s.groups // tp
        q = read(p.sources[0], g0 * per_group * d, g1 * per_group * d, 0)
        k = read(p.sources[1], g0 * d, g1 * d, 0)
        v = read(p.sources[2], g0 * d, g1 * d, 0)
        tail = q.shape[1:]
        parts = [q.reshape(g1 - g0, per_group * d, *tail), k.reshape(g1 - g0, d, *tail), v.reshape(g1 - g0, d, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)
    raise AssertionError(p.layout)


def dict_reader(tensors: dict):
    """A ``read`` over an in-memory HF state dict (the export's round trip, tests)."""

    def read(src: Source, start, stop, dim, col_start=None, col_stop=None):
        t = tensors[src.key]
        t = t.t() if src.transpose else t
        if src.start is not None:
            t = t[src.start:src.stop]
        t = t[start:stop]
        if col_start is not None:
            t = t[:, col_start:col_stop]
        return t.contiguous()

    return read


def safetensors_reader(directory):
    """A ``read`` over a transformers model directory's safetensors files that loads only the
    rows (or columns) asked for; returns (read, close)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        weight_map = None
    else:
        raise ConversionError(f"model.init_from: {directory} has no model.safetensors (or its index)")
    handles = {}

    def handle(key):
        file = directory / (weight_map[key] if weight_map is not None else "model.safetensors")
        if weight_map is not None and key not in weight_map:
            raise ConversionError(f"model.init_from: {directory} has no tensor {key}")
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        if weight_map is None and key not in set(handles[file].keys()):
            raise ConversionError(f"model.init_from: {file} has no tensor {key}")
        return handles[file]

    def read(src: Source, start, stop, dim, col_start=None, col_stop=None):
        sl = handle(src.key).get_slice(src.key)
        base = src.start or 0
        lo = base + (start or 0)
        hi = base + stop if stop is not None else (src.stop if src.stop is not None else None)
        if not src.transpose:
            if len(sl.get_shape()) == 1:
                return sl[lo:hi]
            if col_start is not None:
                return sl[lo:hi, col_start:col_stop]
            return sl[lo:hi, :]
        # Stored [in, out]: our rows are its columns.
        if col_start is not None:
            return sl[col_start:col_stop, lo:hi].t().contiguous()
        return sl[:, lo:hi].t().contiguous()

    return read, handles.clear


# -- this model's shards -> HF ---------------------------------------------------------------


def merge_shards(p: Param, s: Shape, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole parameter from its tensor-parallel shards, one tensor per source of p (in
    Megatron's orientation): q, k, v for qkv; gate, up for gated; the vocabulary cut to hf_vocab."""
    if p.layout == "replicated":
        return [shards[0]]
    if p.layout == "vocab":
        return [torch.cat(shards)[: s.hf_vocab]]
    if p.layout == "column":
        return [torch.cat(shards)]
    if p.layout == "row":
        return [torch.cat(shards, dim=1)]
    if p.layout == "gated":
        halves = [x.chunk(2) for x in shards]
        return [torch.cat([x[0] for x in halves]), torch.cat([x[1] for x in halves])]
    if p.layout == "qkv":
        full = torch.cat(shards)
        d, per_group = s.head_dim, s.heads // s.groups
        tail = full.shape[1:]
        grouped = full.reshape(s.groups, (per_group + 2) * d, *tail)
        q = grouped[:, : per_group * d].reshape(-1, *tail)
        k = grouped[:, per_group * d: (per_group + 1) * d].reshape(-1, *tail)
        v = grouped[:, (per_group + 1) * d:].reshape(-1, *tail)
        return [q, k, v]
    raise AssertionError(p.layout)


def hf_tensors(p: Param, parts: list[torch.Tensor], out: dict, packed: dict):
    """Put the merged parts of p into the HF state dict `out`; parts of a packed tensor (GPT-2's
    c_attn: q, k, v side by side) wait in `packed` until ``finish``."""
    for src, part in zip(p.sources, parts, strict=True):
        if src.start is None:
            out[src.key] = part.t().contiguous() if src.transpose else part.contiguous()
        else:
            packed.setdefault(src.key, (src.transpose, {}))[1][src.start] = part


def finish(out: dict, packed: dict) -> dict:
    """Assemble the packed tensors that ``hf_tensors`` collected into `out`."""
    for key, (transpose, pieces) in packed.items():
        full = torch.cat([pieces[start] for start in sorted(pieces)])
        out[key] = full.t().contiguous() if transpose else full.contiguous()
    return out


def hf_state(recipe, stages: dict, *, vocab: int, hf_vocab: int) -> dict:
    """The HF state dict of a model from the state dicts of all its ranks: stages[(tp rank, pp rank)]
    = {our name: tensor} (names as the rank's GPTModel has them; wrapper prefixes are dropped).
    A tied output layer (a copy of the embedding on the last stage) is left to transformers' tying."""
    arch, m = architecture(recipe), recipe.model
    tp = 1 + max(t for t, _ in stages)
    pp = 1 + max(p for _, p in stages)
    per_stage = m.num_layers // pp
    grouped: dict[str, dict[int, torch.Tensor]] = {}
    for (t, p), state in sorted(stages.items()):
        for name, tensor in state.items():
            canon = canonical_name(name, p * per_stage)
            if canon is None or (canon == "output_layer.weight" and m.tie_embeddings):
                continue
            grouped.setdefault(canon, {})[t] = tensor
    shape = shape_of(recipe, vocab, hf_vocab)
    out, packed = {}, {}
    for canon, shards in grouped.items():
        if sorted(shards) != list(range(tp)):
            raise ConversionError(f"{canon}: the checkpoint has it from tensor-parallel ranks {sorted(shards)} of {tp}")
        p = param(arch, canon, shape, tied=m.tie_embeddings)
        hf_tensors(p, merge_shards(p, shape, [shards[t] for t in range(tp)]), out, packed)
    return finish(out, packed)
