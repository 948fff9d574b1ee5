"""The model's tensors of a Megatron-FSDP checkpoint (``parallel.fsdp: megatron``), for the export.

Such a checkpoint holds no model keys: every rank r writes ``rank{r}/optim``, its shards of the
fp32 main weights (and Adam state) as plain tensors, and ``rank{r}.shards.json``, its shard index
(cce_parallel/train/checkpoint.py): for each main weight, its parameter's name, the parameter's
shape on the rank's tensor-parallel coordinates, the elements [start, stop) of that parameter,
flattened row-major, that the shard holds, and the shard's DCP key (none for an empty shard).
Megatron-FSDP cuts one flat buffer of all parameters into equal parts per data-parallel rank, so
a parameter's shards are uneven and some ranks hold none of it.

``read`` loads the main-weight shards of every rank (nothing else) and ``assemble`` puts each
parameter together on its (tp, pp) coordinates, checking that every element comes from exactly
one shard. The result is what the export reads from the model keys of the other layouts.
"""

import dataclasses
import json
import math
from pathlib import Path

import torch

from cce_parallel.hf.convert import ConversionError


@dataclasses.dataclass
class Shard:
    """One rank's shard of one parameter: elements [start, stop) of it, flattened."""

    rank: int
    tp: int
    pp: int
    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    tensor: torch.Tensor | None  # None for an empty shard


def assemble(shards: list[Shard]) -> dict:
    """{(tp, pp): {name: tensor}} from the shards of every rank. ConversionError naming the first
    parameter (in the order of the shards) whose shapes disagree, whose elements are not all
    covered, or covered twice."""
    params: dict[tuple, list[Shard]] = {}
    for shard in shards:
        params.setdefault((shard.tp, shard.pp, shard.name), []).append(shard)
    stages: dict = {}
    for (t, p, name), pieces in params.items():
        where = f"{name} (tensor-parallel rank {t}, pipeline rank {p})"
        shapes = {piece.shape for piece in pieces}
        if len(shapes) != 1:
            raise ConversionError(f"{where}: the ranks' shard indexes give it different shapes {sorted(shapes)}")
        shape = shapes.pop()
        numel = math.prod(shape)
        full, covered, owner = None, 0, None
        for piece in sorted((q for q in pieces if q.stop > q.start), key=lambda q: (q.start, q.rank)):
            if piece.start > covered:
                raise ConversionError(f"{where}: elements [{covered}, {piece.start}) of {numel} are in no rank's "
                                      "shard (a shard is missing)")
            if piece.start < covered:
                raise ConversionError(f"{where}: elements [{piece.start}, {min(covered, piece.stop)}) are in the "
                                      f"shards of ranks {owner} and {piece.rank}")
            if piece.stop > numel or piece.tensor is None or piece.tensor.numel() != piece.stop - piece.start:
                size = None if piece.tensor is None else piece.tensor.numel()
                raise ConversionError(f"{where}: rank {piece.rank}'s shard [{piece.start}, {piece.stop}) does not fit "
                                      f"its shape {list(shape)} or its {size} stored elements")
            if full is None:
                full = torch.empty(numel, dtype=piece.tensor.dtype)
            full[piece.start:piece.stop] = piece.tensor.reshape(-1)
            covered, owner = piece.stop, piece.rank
        if covered != numel:
            raise ConversionError(f"{where}: elements [{covered}, {numel}) of {numel} are in no rank's shard "
                                  "(a shard is missing)")
        stages.setdefault((t, p), {})[name] = (full if full is not None else torch.empty(0)).reshape(shape)
    return stages


def read(path: Path, meta: dict, metadata) -> dict:
    """{(tp, pp): {name: tensor}} of the Megatron-FSDP checkpoint at path (verified: meta is its
    meta.json, metadata DCP's). ConversionError for a checkpoint without shard indexes (written
    before the train job wrote them) or with an incomplete one."""
    from cce_parallel.train.checkpoint_files import SHARD_INDEX_FORMAT, json_name, read_tensors, shard_index_key

    layout = meta.get("layout", {})
    world = layout.get("world", layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1))
    indexes = []
    for rank in range(world):
        name = json_name(shard_index_key(rank))
        if name not in meta.get("files", {}):
            raise ConversionError(
                f"{path}: this parallel.fsdp=megatron checkpoint has no {name}: it was written before the train job "
                "recorded where Megatron-FSDP's shards sit in the parameters (its ranks' optimizer shards have no "
                "names, shapes or offsets), so it cannot be exported. Resume the run with this version and export "
                "a checkpoint it writes"
            )
        index = json.loads((path / name).read_bytes())  # its sha256 is checked (meta.json lists it)
        if "error" in index:
            raise ConversionError(f"{path / name}: the run could not index its Megatron-FSDP shards: {index['error']}")
        if index.get("format") != SHARD_INDEX_FORMAT:
            raise ConversionError(f"{path / name}: shard index format {index.get('format')}; this version reads "
                                  f"format {SHARD_INDEX_FORMAT}")
        indexes.append(index)
    templates = {}
    for index in indexes:
        for entry in index["params"]:
            if entry["chunk"] != 0:
                raise ConversionError(f"{path}: {entry['name']} is in model chunk {entry['chunk']} (virtual pipeline "
                                      "stages are not supported)")
            key = entry["key"]
            if key is None:
                continue
            item = metadata.state_dict_metadata.get(key)
            if item is None:
                raise ConversionError(f"{path}: rank {index['rank']}'s shard index names {key}, which the checkpoint "
                                      "does not hold")
            templates[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if templates:
        read_tensors(path, templates)
    shards = [
        Shard(index["rank"], index["tp"], index["pp"], entry["name"], tuple(entry["shape"]), entry["start"],
              entry["stop"], templates.get(entry["key"]) if entry["key"] is not None else None)
        for index in indexes for entry in index["params"]
    ]
    return assemble(shards)
