"""Export a train-job checkpoint to a transformers model directory.

    python -m cce_parallel.export CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--keep-padding]
                                  [--data-dir DIR | --no-tokenizer]
    cce-export ...                (the same, as a console script)

CHECKPOINT: a checkpoint directory (``step_0000040``), a checkpoint directory holding ``latest``,
or a run directory (its ``checkpoints/latest``). One process reads it, no GPU and no process
group: ``meta.json`` gives the recipe and the layout; the model's tensors are the DCP keys
``tp{t}_pp{p}/model/0/...`` of TP, PP, DP (one copy), the distributed optimizer (the model's own
weights; in a bf16 run these are bf16), and FSDP (``parallel.fsdp: torch``: DCP reassembles the
DTensor shards). A lean checkpoint (a save on a signal, or ``checkpoint.lean``) leaves out the
model's weights that the optimizer's main weights hold: ``tp{t}_pp{p}.weights.json`` names the
main weight of each, which is read instead (fp32, in a bf16 run too). Megatron-FSDP checkpoints
(``parallel.fsdp: megatron``) hold no model keys: the export puts the fp32 main weights (fp32 in
a bf16 run too) together from every rank's optimizer shards, which each rank's shard index
places in their parameters (megatron_fsdp.py; every element must come from exactly one shard).
Megatron-FSDP checkpoints written before the train job wrote shard indexes are refused, with the
reason.

OUT_DIR gets config.json (GPT2LMHeadModel, LlamaForCausalLM or Gemma2ForCausalLM, see
convert.py), model.safetensors, generation_config.json, and the tokenizer the data was prepared
with (tokenizer.json + tokenizer_config.json, end-of-document token as bos/eos). The vocabulary
is cut to the model's unpadded vocabulary (model.vocab_size, else the tokenizer's) unless
``--keep-padding``: the padded rows are Megatron's tensor-parallel padding, which no token id
names (kept, they stay in the softmax, so the loss is exactly ours).
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from cce_parallel.hf import megatron_fsdp
from cce_parallel.hf.convert import ConversionError, architecture, hf_config, hf_state

_MODEL_KEY = re.compile(r"^tp(\d+)_pp(\d+)/model/(\d+)/(.+)$")
_WEIGHTS_FILE = re.compile(r"^tp(\d+)_pp(\d+)\.weights\.json$")  # checkpoint_state.weights_key's files


def resolve_checkpoint(path) -> Path:
    """The checkpoint directory that path names (see the module doc)."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "meta.json").is_file():
            return candidate
        if (candidate / "latest").is_file():
            return candidate / (candidate / "latest").read_text().strip()
    raise ConversionError(f"{path}: not a checkpoint (no meta.json), nor a directory with checkpoints (no latest)")


def read_checkpoint(path) -> tuple[dict, object, dict]:
    """(meta.json, the recipe, {(tp rank, pp rank): {name: tensor}}) of a checkpoint, after
    checking its files' checksums."""
    from cce_parallel.config import recipe_from_dict
    from cce_parallel.train.checkpoint_files import SafeReader, read_tensors, verify

    path = resolve_checkpoint(path)
    meta = verify(path)
    recipe = recipe_from_dict(meta["recipe"])
    metadata = SafeReader(str(path)).read_metadata()
    if recipe.parallel.fsdp == "megatron":
        return meta, recipe, _check_stages(path, meta, megatron_fsdp.read(path, meta, metadata))
    templates, where = {}, {}
    for key, item in metadata.state_dict_metadata.items():
        match = _MODEL_KEY.match(key)
        if not match:
            continue
        if int(match.group(3)) != 0:
            raise ConversionError(f"{path}: {key} is a second model chunk (virtual pipeline stages are not supported)")
        templates[key] = torch.empty(item.size, dtype=item.properties.dtype)
        where[key] = (int(match.group(1)), int(match.group(2)), match.group(4))
    for name in meta["files"]:  # a lean checkpoint's weights: the main weights they were left out for
        match = _WEIGHTS_FILE.match(name)
        if not match:
            continue
        chunks = json.loads((path / name).read_bytes()).get("chunks") or [{}]
        if len(chunks) > 1:
            raise ConversionError(f"{path}: {name} names a second model chunk (virtual pipeline stages are not "
                                  "supported)")
        for weight, key in chunks[0].items():
            item = metadata.state_dict_metadata.get(key)
            if item is None:
                raise ConversionError(f"{path}: {name} restores {weight} from {key}, which the checkpoint "
                                      "lacks")
            templates[key] = torch.empty(item.size, dtype=item.properties.dtype)
            where[key] = (int(match.group(1)), int(match.group(2)), weight)
    if not templates:
        raise ConversionError(f"{path}: the checkpoint holds no model tensors")
    read_tensors(path, templates)
    stages: dict = {}
    for key, (t, p, name) in where.items():
        stages.setdefault((t, p), {})[name] = templates[key]
    return meta, recipe, _check_stages(path, meta, stages)


def _check_stages(path: Path, meta: dict, stages: dict) -> dict:
    layout = meta.get("layout", {})
    expected = {(t, p) for t in range(layout.get("tp", 1)) for p in range(layout.get("pp", 1))}
    if set(stages) != expected:
        raise ConversionError(f"{path}: model tensors of ranks {sorted(stages)}, the layout {layout} needs {sorted(expected)}")
    return stages


def export(checkpoint, out_dir, *, dtype: str = "fp32", keep_padding: bool = False, data_dir=None,
           tokenizer: bool = True) -> dict:
    """Write the transformers directory of a checkpoint; returns a summary (see the module doc)."""
    if dtype not in ("fp32", "bf16"):
        raise ConversionError(f"--dtype: {dtype!r}; choose fp32 or bf16")
    try:
        from safetensors.torch import save_file
        from transformers import AutoConfig, GenerationConfig
    except ImportError as err:
        raise ImportError("export needs transformers and safetensors: pip install 'cce-parallel[hf]'") from err
    meta, recipe, stages = read_checkpoint(checkpoint)
    arch = architecture(recipe)
    info = _dataset_info(meta, recipe, data_dir) if tokenizer or not keep_padding else None
    if tokenizer and info is None:
        raise ConversionError(
            "the dataset the run was prepared with (its tokenizer) is not found: pass --data-dir DIR, or --no-tokenizer"
        )
    first = stages[min(stages)]
    vocab = next(t.shape[0] for n, t in first.items() if n.endswith("word_embeddings.weight")) * meta["layout"]["tp"]
    m = recipe.model
    if keep_padding:
        hf_vocab = vocab
    elif m.vocab_size is not None:
        hf_vocab = m.vocab_size
    elif info is not None:
        hf_vocab = info.vocab_size
    else:
        raise ConversionError("the unpadded vocabulary is unknown without the dataset: pass --data-dir DIR or --keep-padding")
    state = hf_state(recipe, stages, vocab=vocab, hf_vocab=hf_vocab)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    state = {k: v.to(torch_dtype).contiguous() for k, v in state.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = info.eod_id if info is not None else None
    fields = hf_config(recipe, hf_vocab, eos_token_id=eos)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        _save_tokenizer(info, out)
    return {"architecture": arch, "out_dir": str(out), "step": meta["step"], "vocab_size": hf_vocab,
            "padded_vocab": vocab, "tensors": len(state), "dtype": dtype}


def _dataset_info(meta: dict, recipe, data_dir):
    from cce_parallel.data.info import load_dataset_info

    candidates = [data_dir] if data_dir else [meta.get("dataset"), recipe.data.resolved_dir()]
    for candidate in candidates:
        if candidate and (Path(candidate) / "dataset.json").is_file():
            return load_dataset_info(candidate)
    if data_dir:
        raise ConversionError(f"--data-dir: {data_dir} has no dataset.json")
    return None


def _save_tokenizer(info, out: Path):
    if not info.tokenizer_path:
        raise ConversionError(
            f"the run's tokenizer {info.tokenizer!r} has no tokenizer.json (tiktoken): export with --no-tokenizer"
        )
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    eod = Tokenizer.from_file(info.tokenizer_path).id_to_token(info.eod_id)
    tok = PreTrainedTokenizerFast(tokenizer_file=info.tokenizer_path, eos_token=eod, bos_token=eod)
    tok.save_pretrained(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cce-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint, a checkpoints directory or a run directory")
    parser.add_argument("out_dir", help="the transformers model directory to write")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights' dtype (default fp32)")
    parser.add_argument("--keep-padding", action="store_true", help="keep the padded vocabulary rows")
    parser.add_argument("--data-dir", help="the prepared dataset (its tokenizer); default: the run's")
    parser.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer")
    a = parser.parse_args(argv)
    try:
        summary = export(a.checkpoint, a.out_dir, dtype=a.dtype, keep_padding=a.keep_padding,
                         data_dir=a.data_dir, tokenizer=not a.no_tokenizer)
    except (ConversionError, ValueError) as err:
        print(f"cce-export: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
