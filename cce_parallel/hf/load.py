"""``model.init_from: hf:<dir>``: this rank's shard of a transformers checkpoint into our GPTModel.

Every rank opens the directory's safetensors files and reads, tensor by tensor, only the rows or
columns of its own tensor-parallel shard of its own pipeline stage's parameters (safetensors
slices are read from the memory-mapped file), so no rank ever holds the whole model. The recipe's
model is checked against config.json first; the first difference is an error naming the recipe
key. Padded vocabulary rows past the checkpoint's vocabulary are zeros.
"""

import json
from pathlib import Path

import torch
from megatron.core import parallel_state

from cce_parallel.hf.convert import (
    ConversionError,
    architecture,
    canonical_name,
    check_config,
    local_shard,
    param,
    safetensors_reader,
    shape_of,
)


def init_from_path(spec: str) -> Path:
    """The directory of an ``hf:<dir>`` spec (model.init_from)."""
    if not spec.startswith("hf:") or not spec[3:]:
        raise ConversionError(f"model.init_from: {spec!r} is not hf:<directory>")
    path = Path(spec[3:]).expanduser()
    if not (path / "config.json").is_file():
        raise ConversionError(
            f"model.init_from: {path} is not a transformers model directory (no config.json); give a local "
            "directory as save_pretrained writes it (this job downloads nothing)"
        )
    return path


def load_hf(model, recipe, spec: str, *, tokenizer_vocab: int) -> dict:
    """Load ``hf:<dir>`` into this rank's GPTModel stage (before wrapping); returns a summary."""
    path = init_from_path(spec)
    config = json.loads((path / "config.json").read_text())
    m = recipe.model
    least = m.vocab_size if m.vocab_size is not None else tokenizer_vocab
    check_config(recipe, config, where=f"{path}/config.json", vocab=(least, model.vocab_size))
    read, close = safetensors_reader(path)
    try:
        count = load_state(model, recipe, read, hf_vocab=config["vocab_size"])
    finally:
        close()
    return {"path": str(path), "tensors": count, "architecture": architecture(recipe)}


@torch.no_grad()
def load_state(model, recipe, read, *, hf_vocab: int) -> int:
    """Copy this rank's shards into model's parameters from ``read`` (see convert.local_shard);
    returns the number of tensors loaded."""
    arch = architecture(recipe)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    offset = pp_rank * (recipe.model.num_layers // parallel_state.get_pipeline_model_parallel_world_size())
    shape = shape_of(recipe, model.vocab_size, hf_vocab)
    count = 0
    for name, tensor in model.state_dict().items():
        canon = canonical_name(name, offset)
        if canon is None or not isinstance(tensor, torch.Tensor):
            continue
        value = local_shard(param(arch, canon, shape, tied=recipe.model.tie_embeddings), shape, read, rank, tp)
        if value.shape != tensor.shape:
            raise ConversionError(
                f"{canon}: the checkpoint gives a shard of shape {tuple(value.shape)}, the model's is {tuple(tensor.shape)}"
            )
        tensor.copy_(value)
        count += 1
    return count
