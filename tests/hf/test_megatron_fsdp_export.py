"""Export of Megatron-FSDP checkpoints on CPU (Megatron-FSDP itself needs CUDA; the GPU run is
tests/hf/test_gpu_megatron_fsdp_export.py).

``assemble`` on synthetic shards: uneven, empty on some ranks, in any order; a missing, an
overlapping or a misshapen shard is an error naming the parameter. Then the whole path: ranks
built as Megatron-FSDP builds them (a tiny Llama at TP 2 x DP 2: each tensor-parallel rank's
parameters in one flat buffer cut in equal halves, so the shards are uneven and some empty; the
optimizer holds the shards, ``orig_param`` and ``megatron_fsdp_slice`` say where they sit) go
through the train job's own save code (``encode_optimizer``, ``shard_index``, the Checkpointer),
and ``python -m cce_parallel.export``'s reader gives transformers' weights back exactly. A
checkpoint without shard indexes (written before them), an index with a hole, and one the run
could not write are refused with the reason; the checksums cover the indexes; reading warns of
nothing."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from tests.dist import one_megatron_rank
from tests.hf import tiny

# -- assemble ---------------------------------------------------------------------------------


def _shards(full: dict, cuts: dict, *, tp: int = 0) -> list:
    """Shards of the tensors in full: cuts[name] = [(rank, start, stop)]; 2-D shards as rows."""
    from cce_parallel.hf.megatron_fsdp import Shard

    out = []
    for name, pieces in cuts.items():
        flat = full[name].reshape(-1)
        for rank, start, stop in pieces:
            piece = flat[start:stop]
            if full[name].dim() > 1 and stop > start:
                piece = piece.reshape(-1, *full[name].shape[1:])
            out.append(Shard(rank, tp, 0, name, tuple(full[name].shape), start, stop, piece if stop > start else None))
    return out


FULL = {"w": torch.arange(15.0).reshape(5, 3), "b": torch.arange(7.0) + 100}
CUTS = {"w": [(0, 0, 6), (1, 6, 6), (2, 6, 15)], "b": [(0, 0, 0), (1, 0, 4), (2, 4, 7)]}


def test_assemble_uneven_and_empty_shards_in_any_order():
    from cce_parallel.hf.megatron_fsdp import assemble

    shards = _shards(FULL, CUTS) + _shards({"w": FULL["w"] * 2}, {"w": [(4, 9, 15), (3, 0, 9)]}, tp=1)
    stages = assemble(list(reversed(shards)))
    assert sorted(stages) == [(0, 0), (1, 0)]
    assert torch.equal(stages[(0, 0)]["w"], FULL["w"]) and torch.equal(stages[(0, 0)]["b"], FULL["b"])
    assert torch.equal(stages[(1, 0)]["w"], FULL["w"] * 2)


@pytest.mark.parametrize(("cuts", "message"), [
    ({"w": [(0, 0, 6), (2, 9, 15)]}, r"w \(tensor-parallel rank 0, pipeline rank 0\): elements \[6, 9\) of 15 are in no"),
    ({"w": [(0, 0, 6), (1, 6, 12)]}, r"w .*: elements \[12, 15\) of 15 are in no rank's shard"),
    ({"w": [(1, 6, 6)]}, r"w .*: elements \[0, 15\) of 15 are in no rank's shard"),
    ({"w": [(0, 0, 9), (2, 6, 15)]}, r"w .*: elements \[6, 9\) are in the shards of ranks 0 and 2"),
])
def test_assemble_names_the_first_incomplete_parameter(cuts, message):
    from cce_parallel.hf.convert import ConversionError
    from cce_parallel.hf.megatron_fsdp import assemble

    shards = _shards(FULL, {"b": CUTS["b"]}) + _shards(FULL, cuts)
    with pytest.raises(ConversionError, match=message):
        assemble(shards)


def test_assemble_refuses_shapes_that_disagree():
    from cce_parallel.hf.convert import ConversionError
    from cce_parallel.hf.megatron_fsdp import assemble

    shards = _shards(FULL, {"w": CUTS["w"]})
    shards[0].shape = (3, 5)
    with pytest.raises(ConversionError, match=r"w .*different shapes \[\(3, 5\), \(5, 3\)\]"):
        assemble(shards)
    shards = _shards(FULL, {"w": CUTS["w"]})
    shards[2].tensor = shards[2].tensor[:2]  # 6 elements stored for [6, 15)
    with pytest.raises(ConversionError, match=r"rank 2's shard \[6, 15\) does not fit .* its 6 stored elements"):
        assemble(shards)


# -- the train job's save code -> the export ---------------------------------------------------

TP, DP = 2, 2


@pytest.fixture(scope="module")
def ranks():
    """The tiny Llama's recipe (TP 2, Megatron-FSDP), its transformers weights, and every rank's
    (tensors, JSON documents) as the train job saves them: {rank: (tensors, docs)}."""
    from cce_parallel.config import recipe_from_dict
    from cce_parallel.hf.convert import canonical_name, dict_reader, local_shard, param, shape_of
    from tests.hf.test_layers import ours_from_hf

    with one_megatron_rank():
        hf = tiny.hf_model("llama")
        _, model = ours_from_hf("llama", hf)  # TP 1: the names, and the shapes before TP
        raw = tiny.recipe_dict("llama", tp=TP)
        raw["parallel"]["fsdp"] = "megatron"
        recipe = recipe_from_dict(raw)
        shape = shape_of(recipe, tiny.VOCAB, tiny.VOCAB)
        read = dict_reader(hf.state_dict())
        names = [n for n in model.state_dict() if canonical_name(n) is not None]
        per_tp = {t: {f"module.{n}": local_shard(param("llama", canonical_name(n), shape, tied=False), shape, read, t, TP)
                      for n in names} for t in range(TP)}
    return recipe, hf, {d * TP + t: _rank_state(d * TP + t, t, d, per_tp[t]) for t in range(TP) for d in range(DP)}


def _rank_state(rank: int, t: int, d: int, params: dict, *, drop_slice: str | None = None):
    """What rank (tp t, dp d) saves: Megatron-FSDP's layout of params (one flat buffer, equal
    parts per data-parallel rank), its optimizer over the shards (in another order than the
    buffer's), through the train job's encode_optimizer and shard_index."""
    from cce_parallel.train.checkpoint_files import shard_index_key
    from cce_parallel.train.checkpoint_state import encode_optimizer, shard_index

    total = sum(p.numel() for p in params.values())
    part = -(-total // DP)
    lo, hi = d * part, (d + 1) * part
    named, offset = [], 0
    for name, full in params.items():
        start, stop = min(max(lo - offset, 0), full.numel()), max(min(hi - offset, full.numel()), 0)
        start = min(start, stop)
        local = full.reshape(-1)[start:stop].clone()
        row = full[0].numel() if full.dim() > 1 else 1
        if full.dim() > 1 and local.numel() % row == 0:  # Megatron-FSDP's shards are whole rows
            local = local.reshape(-1, *full.shape[1:])
        shard = torch.nn.Parameter(local)
        shard.orig_param = torch.empty(full.shape, device="meta")
        if name != drop_slice:
            shard.megatron_fsdp_slice = slice(start, stop)
        named.append((name, shard))
        offset += full.numel()
    optimizer = SimpleNamespace(optimizer=torch.optim.AdamW([p for _, p in reversed(named)]))
    engine = SimpleNamespace(model=[SimpleNamespace(param_and_grad_buffer=SimpleNamespace(
        optimizer_named_parameters=named))], optimizer=optimizer)
    key, tensors = f"rank{rank}/optim", {}
    docs = {key: encode_optimizer(optimizer, "megatron", key, tensors)}
    docs[shard_index_key(rank)] = shard_index(engine, key, tensors, rank=rank, coords=(t, 0, d))
    return tensors, docs


def _save(directory, recipe, states: dict, monkeypatch):
    """A checkpoint of states ({rank: (tensors, docs)}) written by the train job's Checkpointer."""
    from cce_parallel.config.loader import recipe_to_dict
    from cce_parallel.train import checkpoint_writer

    tensors, docs = {}, {}
    for part, part_docs in states.values():
        tensors.update(part)
        docs.update(part_docs)
    monkeypatch.setattr(checkpoint_writer, "state_to_save", lambda engine, **_: (tensors, docs))
    meta = {"layout": {"tp": TP, "pp": 1, "dp": DP, "world": TP * DP, "accumulation": 1},
            "recipe": recipe_to_dict(recipe)}
    saver = checkpoint_writer.Checkpointer(directory)
    try:
        saver.save(step=3, consumed_samples=0, engine=SimpleNamespace(scheduler=SimpleNamespace(state_dict=dict)),
                   meta=meta)
    finally:
        saver.close()
    return directory / "step_0000003"


@pytest.fixture
def dist_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_export_puts_the_ranks_shards_together(ranks, tmp_path, dist_group, monkeypatch):
    from safetensors.torch import load_file

    from cce_parallel.hf.export import export

    recipe, hf, states = ranks
    entries = [e for _, docs in states.values() for k, doc in docs.items() if k.endswith("shards") for e in doc["params"]]
    sizes = {e["stop"] - e["start"] for e in entries}
    assert 0 in sizes and len(sizes) > 3  # uneven, and some ranks hold nothing of a parameter
    path = _save(tmp_path / "checkpoints", recipe, states, monkeypatch)
    index = json.loads((path / "rank3.shards.json").read_text())
    assert (index["tp"], index["pp"], index["dp"]) == (1, 0, 1)
    assert index["params"][-1]["name"] == "module.embedding.word_embeddings.weight"  # the optimizer's order

    summary = export(tmp_path, tmp_path / "hf", tokenizer=False, keep_padding=True)
    assert summary["architecture"] == "llama" and summary["vocab_size"] == tiny.VOCAB
    got, want = load_file(str(tmp_path / "hf" / "model.safetensors")), hf.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_export_refuses_checkpoints_without_shard_indexes(ranks, tmp_path, dist_group, monkeypatch):
    from cce_parallel.hf.convert import ConversionError
    from cce_parallel.hf.export import export

    recipe, _, states = ranks
    old = {r: (tensors, {k: v for k, v in docs.items() if not k.endswith("shards")}) for r, (tensors, docs) in states.items()}
    path = _save(tmp_path, recipe, old, monkeypatch)
    with pytest.raises(ConversionError, match="has no rank0.shards.json: it was written before the train job recorded"):
        export(path, tmp_path / "hf", tokenizer=False, keep_padding=True)


def test_export_refuses_an_incomplete_or_failed_index(ranks, tmp_path, dist_group, monkeypatch):
    from cce_parallel.hf.convert import ConversionError
    from cce_parallel.hf.export import read_checkpoint

    recipe, _, states = ranks
    holed = dict(states)
    tensors, docs = states[3]
    index = json.loads(json.dumps(docs["rank3/shards"]))
    dropped = next(e for e in index["params"] if e["key"] is not None and e["start"] > 0)
    index["params"].remove(dropped)
    holed[3] = (tensors, {**docs, "rank3/shards": index})
    path = _save(tmp_path / "holed", recipe, holed, monkeypatch)
    name = dropped["name"].replace(".", r"\.")
    with pytest.raises(ConversionError, match=rf"{name} \(tensor-parallel rank 1, pipeline rank 0\): elements "
                                              rf"\[{dropped['start']}, {dropped['stop']}\) of \d+ are in no rank's shard"):
        read_checkpoint(path)

    failed = dict(states)
    failed[2] = _rank_state(2, 0, 1, {"module.decoder.final_layernorm.weight": torch.ones(32)},
                            drop_slice="module.decoder.final_layernorm.weight")
    path = _save(tmp_path / "failed", recipe, failed, monkeypatch)
    with pytest.raises(ConversionError, match=r"rank2.shards.json: the run could not index its Megatron-FSDP shards: "
                                              r"module\.decoder\.final_layernorm\.weight: .*no orig_param or megatron_fsdp_slice"):
        read_checkpoint(path)


def test_checksums_cover_the_shard_index(ranks, tmp_path, dist_group, monkeypatch):
    from cce_parallel.hf.export import read_checkpoint
    from cce_parallel.train.checkpoint_files import CheckpointError

    recipe, _, states = ranks
    path = _save(tmp_path, recipe, states, monkeypatch)
    file = path / "rank1.shards.json"
    file.write_text(file.read_text().replace('"start": 0', '"start": 1', 1))
    with pytest.raises(CheckpointError, match="rank1.shards.json is corrupt"):
        read_checkpoint(path)


def test_a_failure_to_index_the_shards_never_fails_the_save():
    """What megatron-core gives could change under the index's feet: any error becomes the index's
    reason (the export refuses it with that reason), and the checkpoint is still written. Here its
    buffer's optimizer_named_parameters holds something that is no (name, parameter) pair."""
    from cce_parallel.train.checkpoint_state import shard_index

    engine = SimpleNamespace(model=[SimpleNamespace(param_and_grad_buffer=SimpleNamespace(
        optimizer_named_parameters=[object()]))])
    index = shard_index(engine, "tp0_pp0/optim", {}, rank=1, coords=(0, 0, 1))
    assert index["rank"] == 1 and "params" not in index
    assert index["error"].startswith("TypeError: cannot unpack non-iterable object"), index["error"]


def test_reading_a_checkpoint_warns_of_nothing(ranks, tmp_path, dist_group, monkeypatch):
    """The export reads DCP in one process, as it asks (torch warns at each such load that it
    assumes one process): the model keys of a DDP checkpoint and the shards of a Megatron-FSDP one."""
    from cce_parallel.config.loader import recipe_from_dict
    from cce_parallel.hf.export import read_checkpoint

    recipe, _, states = ranks
    plain = recipe_from_dict(tiny.recipe_dict("llama", tp=TP))
    weights = {t: torch.full((3, 2), float(t)) for t in range(TP)}
    ddp = _save(tmp_path / "ddp", plain, {t: ({f"tp{t}_pp0/model/0/w": weights[t]}, {}) for t in range(TP)},
                monkeypatch)
    fsdp = _save(tmp_path / "fsdp", recipe, states, monkeypatch)
    read = {}
    for path in (ddp, fsdp):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            read[path] = read_checkpoint(path)[2]
        assert not [str(w.message) for w in caught], path
    assert all(torch.equal(read[ddp][(t, 0)]["w"], weights[t]) for t in range(TP))
