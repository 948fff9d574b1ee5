"""megatron-core GPTDatasets over a prepared dataset: one process, and a gloo group of two."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("megatron.core")

from cce_parallel.data import build_gpt_datasets, load_tokenizer
from tests.data.conftest import corpus, write_corpus
from tests.dist import spawn


def documents(prefix) -> set:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return {tuple(ds[i].tolist()[:-1]) for i in range(len(ds))}  # without the EOD


def inner_documents(sample, eod) -> list:
    """The whole documents inside a sample: the pieces between two EODs."""
    text = np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])
    cuts = np.flatnonzero(text == eod)
    return [tuple(text[a + 1 : b].tolist()) for a, b in itertools.pairwise(cuts)]


def test_train_and_validation_read_their_own_files(prepared):
    tok = load_tokenizer(prepared)
    seq = 1024  # longer than the documents, so that whole ones sit inside samples
    train, valid = build_gpt_datasets(
        prepared, seq_length=seq, seed=11, train_samples=500, valid_samples=None, tokenizer=tok
    )
    assert len(train) >= 500
    assert 0 < len(valid) <= prepared.n_valid_tokens // seq  # one epoch, partial sample dropped
    train_docs, valid_docs = documents(prepared.train_prefix), documents(prepared.valid_prefix)
    assert not train_docs & valid_docs
    for ds, own, other in ((train, train_docs, valid_docs), (valid, valid_docs, train_docs)):
        seen = 0
        for i in range(min(len(ds), 200)):
            s = ds[i]
            assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == (seq,)
            assert (s["tokens"][1:] == s["labels"][:-1]).all()  # labels are the next tokens
            assert bool((s["loss_mask"] == 1).all())  # no EOD masking, no padding
            for doc in inner_documents(s, tok.eod):
                assert doc in own and doc not in other
                seen += 1
        assert seen > 0
    cache = os.path.join(prepared.out_dir, "megatron_cache")
    assert any(name.endswith("train-shuffle_index.npy") for name in os.listdir(cache))
    # A second build loads the cache and gives the same samples.
    again, _ = build_gpt_datasets(
        prepared, seq_length=seq, seed=11, train_samples=500, valid_samples=None, tokenizer=tok
    )
    assert all(bool((again[i]["tokens"] == train[i]["tokens"]).all()) for i in (0, 17, 499))


def test_tokenizer_from_another_dataset_is_refused(prepared, tmp_path):
    from cce_parallel.data import train_bpe

    other = train_bpe(["some other text, other text"] * 10, 300)
    with pytest.raises(ValueError, match="not the one"):
        build_gpt_datasets(prepared, seq_length=8, seed=0, train_samples=1, valid_samples=1, tokenizer=other)


def _distributed_worker(rank, world_size, report, out_dir):
    from cce_parallel.data import build_gpt_datasets, load_dataset_info

    info = load_dataset_info(out_dir)
    train, valid = build_gpt_datasets(info, seq_length=32, seed=321, train_samples=300, valid_samples=20)
    report.result(
        "samples",
        (
            len(train),
            len(valid),
            [train[i]["tokens"].tolist() for i in (0, 5, 299)],
            valid[3]["labels"].tolist(),
        ),
    )


@pytest.mark.distributed
def test_gloo_group_builds_on_rank_zero_and_agrees(prepared, tmp_path):
    outcome = spawn(_distributed_worker, 2, (prepared.out_dir,), timeout=180)
    assert outcome.ok, outcome.describe()
    ranks = outcome.merged()["samples"]
    assert ranks[0] == ranks[1]
    # The same as one process computing its own indices (a separate cache directory).
    train, valid = build_gpt_datasets(
        prepared,
        seq_length=32,
        seed=321,
        train_samples=300,
        valid_samples=20,
        path_to_cache=str(tmp_path / "c"),
    )
    assert ranks[0] == (
        len(train),
        len(valid),
        [train[i]["tokens"].tolist() for i in (0, 5, 299)],
        valid[3]["labels"].tolist(),
    )


def test_writing_and_reading_import_megatron_without_its_warnings(tmp_path):
    """megatron-core's first import warns four times that Transformer Engine and apex are missing
    (its optimizer and Megatron-FSDP fall back); preparing and reading the data use neither, and
    say nothing of them. The caller's own warnings still show (its filters are restored)."""
    src = write_corpus(tmp_path / "src", corpus(), "txt")
    code = f"""
import warnings
from cce_parallel.data import build_gpt_datasets, load_tokenizer, prepare_dataset
info = prepare_dataset({str(src)!r}, {str(tmp_path / "out")!r}, vocab_size=300, valid_fraction=0.2)
build_gpt_datasets(info, seq_length=32, seed=1, train_samples=8, valid_samples=None, tokenizer=load_tokenizer(info))
warnings.warn("the caller's own warning")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the caller's own warning" in done.stderr
    assert "Transformer Engine" not in done.stderr and "Apex" not in done.stderr, done.stderr
