"""The Hugging Face source, against a stand-in `datasets` module (no network in tests)."""

import sys
import types

import pytest

from cce_parallel.data.sources import open_source
from tests.data.conftest import corpus


class FakeStream:
    """What datasets.load_dataset(..., streaming=True) gives: an iterable with .info.splits."""

    def __init__(self, docs, known_length):
        self.docs, self.read = docs, 0
        split = types.SimpleNamespace(num_examples=len(docs)) if known_length else None
        self.info = types.SimpleNamespace(splits={"train": split} if known_length else None)

    def __iter__(self):
        for doc in self.docs:
            self.read += 1
            yield {"text": doc, "url": "http://example.com"}


def fake_datasets(docs, *, script_only=False, known_length=True):
    calls = []
    module = types.ModuleType("datasets")

    def load_dataset(name, config=None, *, split, streaming, revision=None):
        calls.append((name, config, split, streaming, revision))
        if script_only and revision is None:
            raise RuntimeError("Dataset scripts are no longer supported, but found openwebtext.py")
        module.stream = FakeStream(docs, known_length)
        return module.stream

    module.load_dataset = load_dataset
    module.calls = calls
    return module


def test_openwebtext_falls_back_to_the_parquet_conversion(monkeypatch):
    fake = fake_datasets(corpus(), script_only=True)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    src = open_source("openwebtext")
    assert src.spec == "hf:Skylion007/openwebtext"
    assert src.count() == len(corpus()) and src.count(10) == 10
    assert list(src) == corpus()
    assert [c[4] for c in fake.calls] == [None, "refs/convert/parquet"]
    assert fake.calls[0][:4] == ("Skylion007/openwebtext", None, "train", True)


def test_unknown_length_is_counted_by_streaming(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(corpus(), known_length=False))
    src = open_source("hf:someone/texts:en")
    assert (src.name, src.config) == ("someone/texts", "en")
    assert src.count() == len(corpus())


def test_load_failure_says_what_to_do(monkeypatch):
    module = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        raise ConnectionError("no network")

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    from cce_parallel.data import DataError

    with pytest.raises(DataError, match=r"(?s)no network.*pass its directory as the source"):
        open_source("openwebtext").count()


def test_prepare_streams_only_up_to_the_last_chosen_document(monkeypatch, tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("megatron.core")
    from cce_parallel.data import prepare_dataset, split_documents

    docs = [f"web page {i}: " + corpus()[i % len(corpus())][:200] for i in range(400)]
    fake = fake_datasets(docs)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    info = prepare_dataset(
        "openwebtext", tmp_path / "owt", vocab_size=300, train_fraction=0.05, valid_fraction=0.01
    )
    train, valid = split_documents(400, 0.05, 0.01, seed=1234)
    assert (info.n_train_documents, info.n_valid_documents) == (20, 4)
    assert info.source == "hf:Skylion007/openwebtext"
    assert fake.stream.read == max(train[-1], valid[-1]) + 1  # stopped after the last chosen one
