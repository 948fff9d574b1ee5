"""prepare_dataset: round trip through megatron's IndexedDataset, splits, sources, idempotence."""

import importlib.util
import json
import logging
import os

import numpy as np
import pytest

from cce_parallel.data import DataError, load_dataset_info, prepare_dataset, split_documents
from tests.data.conftest import write_corpus

needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers"
)
needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs megatron-core"
)


def read_back(info, prefix):
    """Documents of prefix as detokenized strings, checking the EOD after each."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from cce_parallel.data import load_tokenizer

    tok = load_tokenizer(info)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(ds.document_indices) - 1  # one sequence per document
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == info.eod_id and info.eod_id not in ids[:-1]
        assert max(ids) < info.vocab_size
        out.append(tok.detokenize(ids[:-1]))
    return out, sum(len(ds[i]) for i in range(len(ds)))


# -- splits -------------------------------------------------------------------------------------


def test_split_fractions_of_the_paper():
    train, valid = split_documents(100_000, 0.05, 0.0025, seed=1234)
    assert len(train) == 5000 and len(valid) == 250
    assert not set(train.tolist()) & set(valid.tolist())
    assert np.all(np.diff(train) > 0) and np.all(np.diff(valid) > 0)
    # Spread over the whole corpus, not a prefix of it.
    assert train.min() < 1000 and train.max() > 99_000


def test_split_is_seeded_and_validation_independent_of_train_fraction():
    a_train, a_valid = split_documents(10_000, 0.05, 0.01, seed=3)
    b_train, b_valid = split_documents(10_000, 0.05, 0.01, seed=3)
    assert np.array_equal(a_train, b_train) and np.array_equal(a_valid, b_valid)
    _, c_valid = split_documents(10_000, 0.05, 0.01, seed=4)
    assert not np.array_equal(a_valid, c_valid)
    # A larger training fraction keeps the same held-out set and grows the training set.
    d_train, d_valid = split_documents(10_000, 0.5, 0.01, seed=3)
    assert np.array_equal(a_valid, d_valid) and set(a_train.tolist()) <= set(d_train.tolist())
    # None: every document not held out.
    e_train, e_valid = split_documents(10_000, None, 0.01, seed=3)
    assert len(e_train) + len(e_valid) == 10_000 and np.array_equal(e_valid, a_valid)


def test_split_small_and_bad_fractions():
    train, valid = split_documents(10, None, 0.0025, seed=0)
    assert len(valid) == 1 and len(train) == 9  # at least one validation document
    with pytest.raises(ValueError, match="valid_fraction"):
        split_documents(10, None, 0.0, seed=0)
    with pytest.raises(ValueError, match="train_fraction"):
        split_documents(10, 0.9, 0.2, seed=0)
    with pytest.raises(ValueError, match="cannot give"):
        split_documents(1, None, 0.5, seed=0)


# -- round trip and formats ----------------------------------------------------------------------


@needs_tokenizers
@needs_megatron
def test_round_trip_through_indexed_dataset(tmp_path, docs):
    src = write_corpus(tmp_path / "src", docs, "txt")
    info = prepare_dataset(str(src), tmp_path / "out", vocab_size=300, valid_fraction=0.2, seed=5)
    assert info.tokenizer == "bpe" and info.eod_id == 0 and info.vocab_size <= 300
    train, n_train_tokens = read_back(info, info.train_prefix)
    valid, n_valid_tokens = read_back(info, info.valid_prefix)
    # Every document comes back exactly, once, in exactly one split; train keeps source order.
    assert sorted(train + valid) == sorted(docs)
    assert train == [d for d in docs if d in set(train)]
    assert len(valid) == round(len(docs) * 0.2)
    assert (info.n_train_documents, info.n_valid_documents) == (len(train), len(valid))
    assert (info.n_train_tokens, info.n_valid_tokens) == (n_train_tokens, n_valid_tokens)
    expected_train, expected_valid = split_documents(len(docs), None, 0.2, seed=5)
    assert valid == [docs[i] for i in expected_valid]
    assert train == [docs[i] for i in expected_train]


@needs_tokenizers
@needs_megatron
@pytest.mark.parametrize("fmt", ["jsonl", "tar.xz", "jsonl.xz", "txt.xz", "parquet"])
def test_local_formats_give_the_same_dataset(tmp_path, docs, fmt):
    if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
        pytest.skip("needs pyarrow")
    reference = prepare_dataset(
        str(write_corpus(tmp_path / "txt", docs, "txt")), tmp_path / "ref", vocab_size=300
    )
    info = prepare_dataset(str(write_corpus(tmp_path / "src", docs, fmt)), tmp_path / "out", vocab_size=300)
    for prefix in ("train_text_document", "valid_text_document"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / "out" / (prefix + ext)).read_bytes() == (
                tmp_path / "ref" / (prefix + ext)
            ).read_bytes()
    assert (info.n_train_tokens, info.n_valid_tokens) == (reference.n_train_tokens, reference.n_valid_tokens)


@needs_tokenizers
@needs_megatron
def test_paper_fractions_and_filtering(tmp_path):
    docs = [f"document number {i} " + "word " * (i % 7) for i in range(2000)]
    train_idx, valid_idx = split_documents(2000, 0.05, 0.0025, seed=1)
    blank = int(train_idx[3])
    docs[blank] = "   "  # whitespace only: chosen for training, then dropped
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    info = prepare_dataset(
        str(tmp_path / "src"),
        tmp_path / "out",
        vocab_size=300,
        train_fraction=0.05,
        valid_fraction=0.0025,
        seed=1,
    )
    assert (len(train_idx), len(valid_idx)) == (100, 5)
    assert (info.n_train_documents, info.n_valid_documents) == (99, 5)
    train, _ = read_back(info, info.train_prefix)
    valid, _ = read_back(info, info.valid_prefix)
    assert train == [docs[i] for i in train_idx if i != blank]
    assert valid == [docs[i] for i in valid_idx]


@needs_tokenizers
@needs_megatron
def test_max_documents_and_min_chars(tmp_path, docs):
    src = write_corpus(tmp_path / "src", docs, "jsonl")
    info = prepare_dataset(
        str(src),
        tmp_path / "out",
        vocab_size=300,
        valid_fraction=0.1,
        max_documents=20,
        min_document_chars=30,
    )
    train, _ = read_back(info, info.train_prefix)
    valid, _ = read_back(info, info.valid_prefix)
    kept = [d for d in docs[:20] if len(d.strip()) >= 30]
    assert sorted(train + valid) == sorted(kept)


@needs_tokenizers
@needs_megatron
def test_stdlib_offline_default(tmp_path):
    info = prepare_dataset(
        "stdlib", tmp_path / "out", vocab_size=1024, max_documents=1500, valid_fraction=0.01
    )
    assert info.source == "stdlib" and info.vocab_size == 1024
    assert info.n_train_tokens > 200_000 and info.n_valid_documents == 15
    valid, _ = read_back(info, info.valid_prefix)
    assert all(valid)


# -- idempotence --------------------------------------------------------------------------------


@needs_tokenizers
@needs_megatron
def test_idempotent_and_argument_mismatch(tmp_path, docs):
    src = str(write_corpus(tmp_path / "src", docs, "txt"))
    out = tmp_path / "out"
    first = prepare_dataset(src, out, vocab_size=300)
    stamp = os.stat(out / "train_text_document.bin").st_mtime_ns
    again = prepare_dataset(src, out, vocab_size=300)
    assert again == first == load_dataset_info(out)
    assert os.stat(out / "train_text_document.bin").st_mtime_ns == stamp  # nothing rewritten
    with pytest.raises(DataError, match=r"vocab_size.*overwrite"):
        prepare_dataset(src, out, vocab_size=280)
    (out / "megatron_cache").mkdir()  # a stale sample-index cache must not survive new data
    other = prepare_dataset(src, out, vocab_size=280, overwrite=True)
    assert other.args["vocab_size"] == 280 and not (out / "megatron_cache").exists()
    # The directory can move: paths in dataset.json are relative.
    os.rename(out, tmp_path / "moved")
    moved = load_dataset_info(tmp_path / "moved")
    assert moved.train_prefix == str(tmp_path / "moved" / "train_text_document")
    assert (
        json.loads((tmp_path / "moved" / "dataset.json").read_text())["train_prefix"] == "train_text_document"
    )


@needs_tokenizers
@needs_megatron
def test_hf_tokenizer_from_a_local_file(tmp_path, docs, prepared):
    src = write_corpus(tmp_path / "src", docs, "txt")
    spec = f"hf:{prepared.tokenizer_path}"
    info = prepare_dataset(str(src), tmp_path / "out", tokenizer=spec, valid_fraction=0.2)
    assert (
        info.tokenizer == spec and info.eod_id == prepared.eod_id and info.vocab_size == prepared.vocab_size
    )
    assert info.args["vocab_size"] is None  # not a bpe: the vocabulary is the tokenizer's
    assert info.tokenizer_path == str(tmp_path / "out" / "tokenizer.json")  # copied next to the data
    train, _ = read_back(info, info.train_prefix)
    valid, _ = read_back(info, info.valid_prefix)
    assert sorted(train + valid) == sorted(docs)


@needs_tokenizers
@needs_megatron
def test_progress_is_logged_with_counts_and_times(tmp_path, docs, caplog):
    """Each pass says when it starts and what it made (documents, tokens, seconds), so that a first
    preparation is not a silent wait; a prepared dataset takes one line."""
    src = str(write_corpus(tmp_path / "src", docs, "txt"))
    with caplog.at_level(logging.INFO, logger="cce_parallel.data"):
        info = prepare_dataset(src, tmp_path / "out", vocab_size=300, valid_fraction=0.2)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("cce_parallel.data")]
    assert lines[0] == f"preparing {info.out_dir} from {info.source} (first use): counting the documents"
    text = "\n".join(lines)
    n_docs = info.n_train_documents + info.n_valid_documents
    assert f"{info.source}: {n_docs} documents (" in text
    for split, docs_, tokens in (("training", info.n_train_documents, info.n_train_tokens),
                                 ("validation", info.n_valid_documents, info.n_valid_tokens)):
        assert f"tokenized the {split} documents: {docs_:,} documents, {tokens:,} tokens (" in text
    assert lines[-1].startswith(f"prepared {info.out_dir} in ")
    assert lines[-1].endswith(f": {info.n_train_tokens:,} training and {info.n_valid_tokens:,} validation tokens, "
                              f"vocabulary {info.vocab_size}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cce_parallel.data"):
        prepare_dataset(src, tmp_path / "out", vocab_size=300, valid_fraction=0.2)
    assert [r.getMessage() for r in caplog.records] == [
        f"{info.out_dir} holds this dataset already ({info.n_train_tokens:,} training tokens)"]


@needs_tokenizers
@needs_megatron
def test_the_train_job_prints_the_progress(tmp_path, docs, capsys):
    """cce_parallel.train.data.prepare (a run's first start, --prepare-data) shows the data
    package's progress lines on stdout, and leaves its logger as it was."""
    from cce_parallel.config import DataConfig
    from cce_parallel.train.data import prepare

    src = str(write_corpus(tmp_path / "src", docs, "txt"))
    logger = logging.getLogger("cce_parallel.data")
    before = (logger.level, logger.propagate, list(logger.handlers))
    info = prepare(DataConfig(source=src, vocab_size=300, dir=str(tmp_path / "out"), valid_fraction=0.2))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"data: preparing {info.out_dir} from {info.source} (first use): counting the documents"
    assert f"data: tokenized the training documents: {info.n_train_documents:,} documents, " in "\n".join(out)
    assert out[-1].startswith(f"data: prepared {info.out_dir} in ")
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


@needs_tokenizers
@needs_megatron
def test_cli_prints_a_summary(tmp_path, docs, capsys):
    from cce_parallel.data.prepare import main

    src = write_corpus(tmp_path / "src", docs, "jsonl")
    argv = [
        "--source",
        str(src),
        "--out",
        str(tmp_path / "out"),
        "--vocab-size",
        "300",
        "--valid-fraction",
        "0.1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "documents" in out and "tokens" in out and "vocab 300" in out
    assert main(argv + ["--seed", "9"]) == 2
    assert "overwrite" in capsys.readouterr().err
