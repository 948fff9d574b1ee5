"""What a checkpoint holds of the engine, as tensors + JSON: ``state_to_save`` gives this rank's
tensors (for DCP) and its JSON documents (everything else, each tensor replaced by its DCP key,
dtype and shape); ``_encode``, ``_decode`` and ``_templates`` map state to and from that pair
(``encode_optimizer``: the optimizer's); ``shard_index`` is a Megatron-FSDP rank's index of its
shards; the rest reads and restores the model, optimizer (DDP, FSDP2, Megatron-FSDP, distributed
optimizer) and RNG states. No files and no collectives: checkpoint_writer.py writes,
checkpoint.py loads. The public names are those that code outside the checkpoint modules uses
(tests/hf builds the files of Megatron-FSDP ranks with them).
"""

import math
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.distributed.tensor import DTensor

from cce_parallel.train.checkpoint_files import SHARD_INDEX_FORMAT, CheckpointError, shard_index_key
from cce_parallel.train.engine import inner_optimizers

# -- state <-> tensors + JSON -----------------------------------------------------------------


def _encode(obj, key: str, tensors: dict):
    """obj as JSON data; its tensors (and numpy arrays) go into tensors under keys below key."""
    if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.numel() == 0:
        # Nothing to store (Megatron-FSDP leaves some ranks empty shards of a parameter).
        return {"empty": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach()
        return {"tensor": key, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, np.ndarray):
        # torch has no full support for wide unsigned integers (numpy's RNG state is uint32).
        wide_unsigned = obj.dtype.kind == "u" and obj.dtype.itemsize > 1
        data = torch.from_numpy(np.ascontiguousarray(obj.astype(np.int64) if wide_unsigned else obj))
        return {"ndarray": _encode(data, key, tensors), "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):  # e.g. Transformer Engine's FusedAdam keeps its state dtypes
        return {"torch_dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, list):
        return [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, dict) and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
        return {"dict": [[k, _encode(v, f"{key}/{k}", tensors)] for k, v in obj.items()]}
    raise TypeError(f"{key}: a {type(obj).__name__} cannot go into a checkpoint (tensors and plain data only)")


def _decode(doc, tensors: dict):
    if isinstance(doc, list):
        return [_decode(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "tensor" in doc:
        return tensors[doc["tensor"]]
    if "empty" in doc:
        return torch.empty(doc["shape"], dtype=_dtype(doc["empty"]))
    if "ndarray" in doc:
        return _decode(doc["ndarray"], tensors).numpy().astype(np.dtype(doc["dtype"]))
    if "tuple" in doc:
        return tuple(_decode(v, tensors) for v in doc["tuple"])
    if "torch_dtype" in doc:
        return _dtype(doc["torch_dtype"])
    return {k: _decode(v, tensors) for k, v in doc["dict"]}


def _templates(doc, out: dict) -> dict:
    """Empty tensors for the tensor entries of doc that out lacks, to load into (DCP loads in place)."""
    if isinstance(doc, list):
        for v in doc:
            _templates(v, out)
    elif isinstance(doc, dict):
        if "tensor" in doc:
            if doc["tensor"] not in out:
                out[doc["tensor"]] = torch.empty(doc["shape"], dtype=_dtype(doc["dtype"]))
        else:
            for v in doc.values():
                _templates(v, out)
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint")
    return dtype


# -- the engine's state ------------------------------------------------------------------------


def _coords():
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _is_distributed_optimizer(optimizer) -> bool:
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(type(m).__name__ == "DistributedOptimizer" for m in members)


def _optimizer_state(optimizer, fsdp: str = "none") -> list[dict]:
    """What the checkpoint holds of the optimizer: its torch optimizers' state dicts and main
    weights; under Megatron-FSDP (fsdp="megatron") this rank's shards of them, as plain tensors."""
    state = [
        {"state_dict": inner.state_dict(),
         "main_params": [p.detach() for group in inner.param_groups for p in group["params"]]}
        for inner in inner_optimizers(optimizer)
    ]
    return _local(state) if fsdp == "megatron" else state


def encode_optimizer(optimizer, fsdp: str, key: str, tensors: dict) -> dict:
    """What the checkpoint holds of the optimizer (``_optimizer_state``) as the JSON document of
    ``key``, its tensors put into ``tensors`` under keys below ``key``."""
    return _encode(_optimizer_state(optimizer, fsdp), key, tensors)


def _load_optimizer_state(optimizer, saved: list[dict], *, loaded_in_place: bool = False):
    """Restore the saved optimizer state. loaded_in_place (Megatron-FSDP): DCP has already loaded
    every tensor into this rank's shards; only the param groups' hyperparameters and non-tensor
    state remain (load_state_dict would replace the DTensor states by the plain shards)."""
    inners = inner_optimizers(optimizer)
    if len(inners) != len(saved):
        raise ValueError(f"the checkpoint holds {len(saved)} optimizers, this run has {len(inners)}")
    for inner, item in zip(inners, saved):
        if loaded_in_place:
            _restore_untensored(inner, item["state_dict"])
            continue
        inner.load_state_dict(item["state_dict"])
        params = [p for group in inner.param_groups for p in group["params"]]
        for param, value in zip(params, item["main_params"], strict=True):
            param.copy_(value)


def _fsdp(engine) -> str:
    """How the model is sharded: "torch" (FSDP2: the parameters and optimizer state are DTensor
    shards), "megatron" (Megatron-FSDP: likewise, in buffers of its own) or "none"."""
    from megatron.core.distributed import TorchFullyShardedDataParallel

    for chunk in engine.model:
        if isinstance(chunk, TorchFullyShardedDataParallel):
            return "torch"
        if getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False):
            return "megatron"
    return "none"


def _local(obj):
    """obj with every DTensor replaced by this rank's shard (a view of it)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


class _NoIndex(Exception):
    """What megatron-core gave falls short of a shard index (the reason)."""


def shard_index(engine, optim_key: str, tensors: dict, *, rank: int, coords: tuple[int, int, int]) -> dict:
    """Under Megatron-FSDP, this rank's shard index (``rank{r}.shards.json``, see checkpoint.py):
    for every main weight in ``optim_key`` (the optimizer's parameters, in its order), the name of
    its parameter, the parameter's shape on this tensor-parallel rank, and the elements of that
    parameter, flattened row-major, that this rank's shard holds ([start, stop), empty on some
    ranks). The optimizer's parameters are the DTensors of the buffer's
    ``optimizer_named_parameters`` (megatron-core 0.16 and 0.19): ``orig_param`` is the module's
    parameter, ``megatron_fsdp_slice`` the range, which the shard's own size is checked against.
    Where megatron-core gives less, the index says why (the export refuses it; training goes on)."""
    tp, pp, dp = coords
    index = {"format": SHARD_INDEX_FORMAT, "rank": rank, "tp": tp, "pp": pp, "dp": dp}
    try:
        index["params"] = _shard_entries(engine, optim_key, tensors)
    except Exception as err:  # noqa: BLE001 - the index serves the export: it never costs the save
        index["error"] = str(err) if isinstance(err, _NoIndex) else f"{type(err).__name__}: {err}"
    return index


def _shard_entries(engine, optim_key: str, tensors: dict) -> list[dict]:
    named = {}
    for chunk_index, chunk in enumerate(engine.model):
        buffer = getattr(chunk, "param_and_grad_buffer", None)  # megatron-core's adapter: its module's
        if buffer is None:
            buffer = getattr(getattr(chunk, "module", None), "param_and_grad_buffer", None)
        pairs = getattr(buffer, "optimizer_named_parameters", None)
        if pairs is None:
            raise _NoIndex(f"model chunk {chunk_index} has no param_and_grad_buffer.optimizer_named_parameters")
        for name, param in pairs:
            named[id(param)] = (chunk_index, name, param)
            # A copy of the parameter in the optimizer would still name the module's parameter.
            named.setdefault(id(getattr(param, "orig_param", param)), (chunk_index, name, param))
    entries = []
    for i, inner in enumerate(inner_optimizers(engine.optimizer)):
        for j, param in enumerate(p for group in inner.param_groups for p in group["params"]):
            found = named.get(id(param)) or named.get(id(getattr(param, "orig_param", param)))
            if found is None:
                raise _NoIndex(f"parameter {j} of optimizer {i} is none of Megatron-FSDP's optimizer_named_parameters")
            chunk_index, name, fsdp_param = found
            orig, where = getattr(fsdp_param, "orig_param", None), getattr(fsdp_param, "megatron_fsdp_slice", None)
            if orig is None or not isinstance(where, slice):
                raise _NoIndex(f"{name}: megatron-core gives it no orig_param or megatron_fsdp_slice")
            shape, local = list(orig.shape), _local(param)
            start, stop = int(where.start or 0), int(where.stop or 0)
            if not 0 <= start <= stop <= math.prod(shape) or stop - start != local.numel():
                raise _NoIndex(f"{name}: megatron_fsdp_slice [{start}, {stop}) does not fit its shape {shape} and "
                               f"this rank's shard of {local.numel()} elements")
            # The key encode_optimizer gives this main weight (an empty shard has none).
            key = f"{optim_key}/{i}/main_params/{j}" if local.numel() else None
            if key is not None and key not in tensors:
                raise _NoIndex(f"{name}: its shard is not {key} in the checkpoint")
            entries.append({"name": name, "chunk": chunk_index, "shape": shape, "start": start, "stop": stop,
                            "key": key})
    return entries


def _restore_untensored(inner, saved_dict: dict):
    """The param groups' hyperparameters and the non-tensor state of a torch optimizer."""
    for group, saved_group in zip(inner.param_groups, saved_dict["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    params = [p for group in inner.param_groups for p in group["params"]]
    for index, entries in saved_dict["state"].items():
        plain = {k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)}
        inner.state[params[int(index)]].update(plain)


def _init_optimizer_state(optimizer, *, skip_empty: bool = False):
    """Create the state of optimizers that have taken no step yet (zero gradients, lr 0; Adam's
    moments and step are then overwritten by the checkpoint), so that under FSDP their DTensor
    shards exist for DCP to load into. skip_empty: not for parameters whose shard on this rank is
    empty (Megatron-FSDP gives them no gradient, so training gives them no state)."""
    for inner in inner_optimizers(optimizer):
        if inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if skip_empty:
            params = [p for p in params if _local(p).numel() > 0]
        lrs = [group["lr"] for group in inner.param_groups]
        for param in params:
            param.grad = torch.zeros_like(param)
        for group in inner.param_groups:
            group["lr"] = 0.0
        inner.step()
        for group, lr in zip(inner.param_groups, lrs):
            group["lr"] = lr
        for param in params:
            param.grad = None


def _optim_key(optimizer, tp: int, pp: int, rank: int) -> str:
    return f"rank{rank}/optim" if _is_distributed_optimizer(optimizer) else f"tp{tp}_pp{pp}/optim"


def _model_state(engine, tp: int, pp: int) -> dict:
    state = {}
    for i, chunk in enumerate(engine.model):
        for name, value in _unwrap(chunk).state_dict().items():
            if isinstance(value, torch.Tensor):
                state[f"tp{tp}_pp{pp}/model/{i}/{name}"] = value
            elif value is not None:  # megatron's local layers have _extra_state None: nothing to save
                raise TypeError(f"model state {name}: a {type(value).__name__}; checkpoints hold tensors only")
    return state


def weights_key(tp: int, pp: int) -> str:
    """The key of a lean checkpoint's document (``tp{t}_pp{p}.weights.json``) that names, for each
    model weight left out, the DCP key of the optimizer's main weight it is restored from."""
    return f"tp{tp}_pp{pp}/weights"


def _main_weights(engine, optim_key: str) -> list[dict] | None:
    """For each model chunk, {state-dict name: the DCP key ``encode_optimizer`` gives its main
    weight} of every parameter in its state dict; None where some parameter has no main weight
    in this rank's optimizer state (then the checkpoint keeps the model's weights). A main weight
    is the optimizer's own parameter: the model's parameter itself (fp32 runs, FSDP2's DTensors)
    or megatron's fp32 copy of a bf16 parameter (``float16_groups`` -> ``fp32_from_float16_groups``).
    The distributed optimizer holds a shard of each main weight only: None."""
    if _is_distributed_optimizer(engine.optimizer) or _fsdp(engine) == "megatron":
        return None
    members = [m for m in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
               if getattr(m, "optimizer", None) is not None]
    found = {}  # id(model parameter) -> DCP key of its main weight
    for i, member in enumerate(members):
        params = (p for group in member.optimizer.param_groups for p in group["params"])
        position = {id(p): j for j, p in enumerate(params)}
        pairs = dict(position)  # the optimizer's own parameters, and below megatron's bf16 ones
        for model_group, main_group in zip(getattr(member, "float16_groups", []),
                                           getattr(member, "fp32_from_float16_groups", []), strict=True):
            for model_param, main_param in zip(model_group, main_group, strict=True):
                if id(main_param) in position:
                    pairs[id(model_param)] = position[id(main_param)]
        for pid, j in pairs.items():
            found.setdefault(pid, f"{optim_key}/{i}/main_params/{j}")
    chunks = []
    for chunk in engine.model:
        names = {}
        # The state dict's own entries, as objects: its names are not always named_parameters'
        # (megatron's Float16Module gives its inner module's state dict, without "module.").
        for name, value in _unwrap(chunk).state_dict(keep_vars=True).items():
            if not isinstance(value, torch.nn.Parameter):
                continue  # a buffer: saved as it is
            if id(value) not in found:
                return None
            names[name] = found[id(value)]
        chunks.append(names)
    return chunks if any(chunks) else None


def state_to_save(engine, *, lean: bool = False) -> tuple[dict, dict]:
    """(tensors for DCP, {key: JSON document}) of this rank's share of the state. lean: leave out
    the model's weights where the optimizer state holds a main weight for every one of them
    (``_main_weights``); ``weights_key``'s document then names where each is."""
    rank = dist.get_rank()
    tp, pp, dp = _coords()
    tensors, docs = {}, {}
    docs[f"rank{rank}/rng"] = _encode(_rng_state(), f"rank{rank}/rng", tensors)
    # Every data-parallel rank offers its replica of the model under the same keys: DCP writes each
    # such tensor once, the writes spread over those ranks. A replicated optimizer (no distributed
    # optimizer) comes from data-parallel rank 0 alone: offered by every rank, its 12 bytes per
    # parameter would be staged in host memory on every rank. Under FSDP2 every data-parallel rank
    # holds a shard of each tensor (DTensors: DCP writes each shard under the shared key), and
    # data-parallel rank 0 writes the JSON, which records the full shapes. Under Megatron-FSDP every
    # rank writes its own optimizer shards (main weights included) as plain tensors, and its shard
    # index (where each main-weight shard sits in its parameter); the model's bf16 weights are
    # copies of those main weights, rebuilt on load.
    fsdp = _fsdp(engine)
    sharded = fsdp == "torch"
    if fsdp != "megatron":
        model = _model_state(engine, tp, pp)
        chunks = _main_weights(engine, _optim_key(engine.optimizer, tp, pp, rank)) if lean else None
        if chunks is not None:
            # A lean save: the weights are restored from the main weights, which the optimizer's
            # entries below hold (written by data-parallel rank 0, or as shards under FSDP2).
            for i, names in enumerate(chunks):
                for name in names:
                    del model[f"tp{tp}_pp{pp}/model/{i}/{name}"]
            if dp == 0:
                docs[weights_key(tp, pp)] = {"chunks": chunks}
        tensors.update(model)
    if dp == 0 or sharded or _is_distributed_optimizer(engine.optimizer):
        key = _optim_key(engine.optimizer, tp, pp, rank)
        doc = encode_optimizer(engine.optimizer, fsdp, key, tensors)
        if dp == 0 or not sharded:
            docs[key] = doc
        if fsdp == "megatron":  # what the export needs to put the shards together
            docs[shard_index_key(rank)] = shard_index(engine, key, tensors, rank=rank, coords=(tp, pp, dp))
    return tensors, docs


def _unwrap(chunk):
    """The module under megatron's DDP / the CPU LocalDDP (Float16Module stays: its state dict
    is the GPTModel's, under the prefix ``module.``)."""
    return chunk.module
