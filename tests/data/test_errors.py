"""Failures name what is wrong: missing sources, unknown tokenizers, missing optional packages."""

import importlib.util
import json

import pytest

from cce_parallel.data import load_dataset_info, load_tokenizer, prepare_dataset
from cce_parallel.data.sources import open_source


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file or directory.*'stdlib', 'openwebtext'"):
        prepare_dataset(str(tmp_path / "nowhere"), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="'owt'"):
        prepare_dataset("owt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_directory_without_text_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.md").write_text("not a supported suffix")
    with pytest.raises(FileNotFoundError, match=r"holds no file to read.*\.txt/\.jsonl/\.parquet/\.xz"):
        prepare_dataset(str(tmp_path / "src"), tmp_path / "out")


def test_jsonl_without_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"a\.jsonl:2: expected a JSON object with a 'text' field"):
        list(open_source(str(tmp_path / "a.jsonl")))


@pytest.mark.parametrize("spec", ["gpt2", "sentencepiece:x", "hf:", "tiktoken:", "BPE"])
def test_unknown_tokenizer(tmp_path, spec):
    with pytest.raises(
        ValueError, match=r"unknown tokenizer.*'bpe', 'hf:<name or path>' or 'tiktoken:<encoding>'"
    ):
        prepare_dataset("stdlib", tmp_path / "out", tokenizer=spec)


def test_tokenizer_names_that_cannot_load():
    with pytest.raises(ValueError, match="trained per dataset"):
        load_tokenizer("bpe")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_tokenizer("hf:./no/such/tokenizer.json")


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is not None, reason="tiktoken is installed")
def test_tiktoken_missing():
    with pytest.raises(ImportError, match="pip install tiktoken"):
        load_tokenizer("tiktoken:gpt2")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_datasets_missing():
    with pytest.raises(ImportError, match="pip install datasets"):
        open_source("openwebtext").count()


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_pyarrow_missing(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        open_source(str(tmp_path)).count()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="valid_fraction"):
        prepare_dataset("stdlib", tmp_path / "out", valid_fraction=0)
    with pytest.raises(ValueError, match="train_fraction"):
        prepare_dataset("stdlib", tmp_path / "out", train_fraction=1.0)
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_dataset("stdlib", tmp_path / "out", vocab_size=100)
    with pytest.raises(ValueError, match="max_documents"):
        prepare_dataset("stdlib", tmp_path / "out", max_documents=1)


def test_info_of_an_unprepared_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare the dataset first"):
        load_dataset_info(tmp_path)
