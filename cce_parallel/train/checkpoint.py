"""Checkpoints: model, optimizer, scheduler, data position and RNG states, written atomically,
checked before use, and made of tensors and plain data only.

Each checkpoint ``<dir>/step_0000040/`` is one torch.distributed.checkpoint (DCP) save of tensors,
written by every rank in parallel (``*.distcp`` files and DCP's ``.metadata``), a small JSON file
per state object, and ``meta.json``. The DCP state dict holds:

    tp{t}_pp{p}/model/{chunk}/...   the model chunks' state dicts (weights in the model's dtype),
                                    replicated over data parallelism: DCP writes each tensor once,
                                    the writes spread over the data-parallel ranks
    tp{t}_pp{p}/optim/...           by data-parallel rank 0: the optimizer (replicated over data
                                    parallelism)
    rank{r}/optim/...               instead, with the distributed optimizer: every rank's shard
    rank{r}/rng/...                 every rank: numpy, torch (and CUDA + Megatron tracker) RNGs

Under FSDP (``parallel.fsdp: torch``) the model and optimizer keys are the same, but every
data-parallel rank writes its DTensor shards of them (DCP records each shard's offsets in the
full tensor; data-parallel rank 0 writes the JSON). Loading builds the optimizer's state first
(a step with zero gradients and learning rate 0), so that DCP loads into the live DTensor shards
of the weights and Adam state. DCP reshards on load, so a DDP checkpoint resumes under FSDP and
an FSDP one under DDP (same tp, pp, dp).

Under Megatron-FSDP (``parallel.fsdp: megatron``) every rank writes ``rank{r}/optim`` only: its
shards of the fp32 main weights and Adam state as plain tensors (Megatron-FSDP's shards are
uneven and some are empty, which DTensor's metadata cannot describe without collectives of its
own). The model's bf16 weights are copies of the main weights and are rebuilt from them on load.
Such a checkpoint resumes under Megatron-FSDP with the same layout only (checked). Every rank
also writes its shard index, ``rank{r}.shards.json``: for each of its main-weight shards, the
parameter's name (as the model keys above name it), its shape on the rank's tensor-parallel
coordinates, and which of its elements (flattened row-major) the shard holds, so that the export
(cce_parallel/hf/megatron_fsdp.py) can put every parameter together. Loading does not read it:
checkpoints written before it existed resume the same (the export refuses them).

A lean checkpoint (the save on a signal or at train.exit_duration; every save with
``checkpoint.lean``) leaves out the model's weights where the optimizer's entries hold a main
weight for every parameter of the stage (fp32: the parameters themselves; bf16: megatron's fp32
copies; not with the distributed optimizer, whose ranks hold shards of them). Buffers stay.
``tp{t}_pp{p}.weights.json`` then maps each weight left out to the DCP key of its main weight,
and meta.json's ``model_weights`` is ``main_params`` (``model`` otherwise). Loading copies the
main weights into the model (cast to its dtype, as the optimizer's step does); the export reads
them instead of the weights.

Keys carry the rank coordinates because DCP treats equal keys on several ranks as one replicated
value: the tensor-parallel shards of a parameter share its name.

The optimizer is saved as what its torch optimizers hold: their state dicts (Adam moments, step
counts, hyperparameters) and the values of their parameters, which are the main weights: the
model's own parameters in fp32 runs, megatron's fp32 copies with bf16, or this rank's shard of
them under the distributed optimizer. Restoring both the model weights and the main weights
makes a resumed step bitwise the uninterrupted one (on CPU; GPUs add their own nondeterminism).
Every tensor of a state object goes into DCP under the object's key; what remains (the nesting,
hyperparameters, python's RNG) is written to ``<key>.json`` (``rank3.rng.json``,
``tp0_pp0.optim.json``) with each tensor replaced by its DCP key, dtype and shape, so its size
follows the number of tensors, not their sizes. Nothing in a checkpoint is unpickled into
objects: tensors are read with ``weights_only``, and DCP's ``.metadata`` through an unpickler that
admits DCP's own metadata classes only.

``meta.json`` (step, consumed samples, parallel layout, scheduler state, recipe) lists the size
and sha256 of every other file and carries the sha256 of its own content. Resuming checks them
all (every rank hashes a share of the files): with ``checkpoint.resume: auto`` a checkpoint that
fails is skipped with a warning naming the bad file, and the newest one that passes is used (with
``checkpoint.keep`` >= 2 there is one to fall back to); a checkpoint named explicitly must pass.

Every rank writes into ``.tmp_step_0000040``, in the background (``Checkpointer``: training waits
only while the state is copied to host memory). Each file is hashed as DCP writes it; once every
rank is done, rank 0 writes meta.json, renames the directory to ``step_0000040`` and then replaces
``latest`` (a one-line file naming it, for people and scripts) through a temporary file and
``os.replace``. A crash or kill at any point, during the background write too, leaves the earlier
checkpoints intact; the next start removes the ``.tmp_`` leftovers. Resuming needs the same
parallel layout (tp, pp, dp): the keys name the coordinates, so the checkpoint does not reshard.

The run directory is locked (``.lock``, an exclusive ``flock`` held by rank 0 while it lives), so
that a second run cannot write into it; the kernel drops the lock when its holder dies, even by
SIGKILL, so a killed run never blocks its own restart.

This module is the checkpoint API (``save``, ``load`` and the names of the other modules that
callers use); the pieces live in checkpoint_files.py (names, meta.json, checksums, verification,
the lock, safe reading), checkpoint_state.py (the engine's state as tensors + JSON) and
checkpoint_writer.py (``Checkpointer``: host buffers, the background write, publishing).
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cce_parallel.train.checkpoint_files import (
    CheckpointError,
    SafeReader,
    TensorsOnly,
    checkpoints,
    json_name,
    latest_checkpoint,
    lock_run_dir,
    newest_valid,
    read_meta,
    step_name,
    verify,
    verify_collective,
)
from cce_parallel.train.checkpoint_state import (
    _coords,
    _decode,
    _fsdp,
    _init_optimizer_state,
    _load_optimizer_state,
    _model_state,
    _optim_key,
    _set_rng_state,
    _templates,
    _unwrap,
    encode_optimizer,
    weights_key,
)
from cce_parallel.train.checkpoint_writer import Checkpointer

# The checkpoint API, whichever module defines each name.
__all__ = [
    "CheckpointError",
    "Checkpointer",
    "checkpoints",
    "latest_checkpoint",
    "load",
    "lock_run_dir",
    "newest_valid",
    "read_meta",
    "save",
    "verify",
    "verify_collective",
]


def save(directory, *, step: int, consumed_samples: int, engine, meta: dict, keep: int = 0,
         lean: bool = False) -> Path:
    """Write a checkpoint of the current state and wait for it (collective: every rank calls it);
    lean: without the model weights that the optimizer's main weights hold."""
    saver = Checkpointer(directory, keep=keep)
    try:
        saver.save(step=step, consumed_samples=consumed_samples, engine=engine, meta=meta, lean=lean)
    finally:
        saver.close()
    return Path(directory) / step_name(step)


@torch.no_grad()  # copies into parameters
def load(path, *, engine, layout: dict) -> dict:
    """Restore the state saved in checkpoint `path` into engine (collective); returns its meta.
    The files are not hashed here: ``verify_collective`` checks them before."""
    path = Path(path)
    meta = read_meta(path)
    saved = meta.get("layout", {})
    if any(saved.get(k) != layout[k] for k in ("tp", "pp", "dp")):
        raise ValueError(
            f"checkpoint {path} was written with tp={saved.get('tp')} pp={saved.get('pp')} dp={saved.get('dp')}; "
            f"this run has tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}. Resuming needs the same layout"
        )
    fsdp = _fsdp(engine)
    saved_fsdp = meta.get("recipe", {}).get("parallel", {}).get("fsdp", "none")
    if (saved_fsdp == "megatron") != (fsdp == "megatron"):
        raise ValueError(
            f"checkpoint {path} was written with parallel.fsdp={saved_fsdp}; "
            f"this run has parallel.fsdp={fsdp}. "
            "A Megatron-FSDP checkpoint holds each rank's own shards: it resumes under Megatron-FSDP only, "
            "and Megatron-FSDP resumes from its own checkpoints only"
        )
    tp, pp, _dp = _coords()
    rank = dist.get_rank()
    rng_key, optim_key = f"rank{rank}/rng", _optim_key(engine.optimizer, tp, pp, rank)
    # A lean checkpoint names the main weight of each model weight it left out (meta.json's files
    # list the document, so a lost one fails verification).
    lean = json_name(weights_key(tp, pp)) in meta["files"]
    docs = {}
    for key in (rng_key, optim_key) + ((weights_key(tp, pp),) if lean else ()):
        try:
            docs[key] = json.loads((path / json_name(key)).read_bytes())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path / json_name(key)} is unreadable ({err})") from None
    # DCP loads in place into a template of the same keys: the model's own state dict (every data-
    # parallel rank reads the copy data-parallel rank 0 wrote) and empty tensors shaped as saved.
    state = _model_state(engine, tp, pp) if fsdp != "megatron" else {}
    from_main = {}  # {chunk: {name: the DCP key of its main weight}} of the weights left out
    if lean:
        chunks = docs.pop(weights_key(tp, pp)).get("chunks")
        if not isinstance(chunks, list) or len(chunks) != len(engine.model):
            raise CheckpointError(f"{path / json_name(weights_key(tp, pp))}: not {len(engine.model)} "
                                  "model chunks")
        for i, names in enumerate(chunks):
            from_main[i] = names
            for name, key in names.items():
                if not key.startswith(f"{optim_key}/"):
                    raise CheckpointError(f"{path / json_name(weights_key(tp, pp))}: {name} from {key}, "
                                          f"not from this rank's optimizer state {optim_key}")
                state.pop(f"tp{tp}_pp{pp}/model/{i}/{name}", None)
    if fsdp != "none":
        # Shards to load into: the optimizer's own state (DCP loads in place), then the saved
        # document's tensor entries resolve to them.
        _init_optimizer_state(engine.optimizer, skip_empty=fsdp == "megatron")
        if fsdp == "megatron":
            mine = {}
            encode_optimizer(engine.optimizer, fsdp, optim_key, mine)
            saved_keys = set(_templates(docs[optim_key], {}))
            if set(mine) != saved_keys:
                raise CheckpointError(
                    f"{path / json_name(optim_key)}: the optimizer state does not match this rank's shards "
                    f"({len(saved_keys)} tensors saved, {len(mine)} here)"
                )
            state.update(mine)
        else:
            encode_optimizer(engine.optimizer, fsdp, optim_key, state)
    for doc in docs.values():
        _templates(doc, state)
    dcp.load(state, storage_reader=SafeReader(path), planner=TensorsOnly())
    for i, chunk in enumerate(engine.model):
        if fsdp == "megatron":
            chunk.module.install_optimized_model_weights()  # fp32 main weights -> bf16 weights
            continue
        prefix, module = f"tp{tp}_pp{pp}/model/{i}/", _unwrap(chunk)
        own = module.state_dict()  # with its None entries
        own.update({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        # Weights left out: their main weights, cast to the model's dtype by the copy (as the
        # optimizer's step makes them).
        own.update({name: state[key] for name, key in from_main.get(i, {}).items()})
        module.load_state_dict(own)
    saved_optimizer = _decode(docs[optim_key], state)
    _load_optimizer_state(engine.optimizer, saved_optimizer, loaded_in_place=fsdp == "megatron")
    engine.scheduler.load_state_dict(meta["scheduler"])
    _set_rng_state(_decode(docs[rng_key], state))
    dist.barrier()
    return meta
