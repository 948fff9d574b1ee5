"""Failures name what is wrong: missing sources, unknown tokenizers, missing optional packages."""

import importlib.util
import json

import pytest

from cce_parallel.data import DataError, load_dataset_info, load_tokenizer, prepare_dataset
from cce_parallel.data.sources import open_source
from tests.helpers import child_pythonpath


def test_missing_source(tmp_path):
    with pytest.raises(DataError, match=r"no such file or directory.*'stdlib', 'openwebtext'"):
        prepare_dataset(str(tmp_path / "nowhere"), tmp_path / "out")
    with pytest.raises(DataError, match="'owt'"):
        prepare_dataset("owt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_directory_without_text_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.md").write_text("not a supported suffix")
    with pytest.raises(DataError, match=r"holds no file to read.*\.txt/\.jsonl/\.parquet/\.xz"):
        prepare_dataset(str(tmp_path / "src"), tmp_path / "out")


def test_jsonl_without_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(DataError, match=r"a\.jsonl:2: expected a JSON object with a 'text' field"):
        list(open_source(str(tmp_path / "a.jsonl")))


@pytest.mark.parametrize("spec", ["gpt2", "sentencepiece:x", "hf:", "tiktoken:", "BPE"])
def test_unknown_tokenizer(tmp_path, spec):
    with pytest.raises(
        DataError, match=r"unknown tokenizer.*'bpe', 'hf:<name or path>' or 'tiktoken:<encoding>'"
    ):
        prepare_dataset("stdlib", tmp_path / "out", tokenizer=spec)


def test_tokenizer_names_that_cannot_load():
    with pytest.raises(DataError, match="trained per dataset"):
        load_tokenizer("bpe")
    with pytest.raises(DataError, match="no such file or directory"):
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
    with pytest.raises(DataError, match="valid_fraction"):
        prepare_dataset("stdlib", tmp_path / "out", valid_fraction=0)
    with pytest.raises(DataError, match="train_fraction"):
        prepare_dataset("stdlib", tmp_path / "out", train_fraction=1.0)
    with pytest.raises(DataError, match="vocab_size"):
        prepare_dataset("stdlib", tmp_path / "out", vocab_size=100)
    with pytest.raises(DataError, match="max_documents"):
        prepare_dataset("stdlib", tmp_path / "out", max_documents=1)


def test_info_of_an_unprepared_directory(tmp_path):
    with pytest.raises(DataError, match="prepare the dataset first"):
        load_dataset_info(tmp_path)
    for text in ("{not json", '{"tokenizer": "bpe"}', "[1, 2]"):
        (tmp_path / "dataset.json").write_text(text)
        with pytest.raises(DataError, match=r"dataset\.json is not a dataset description"):
            load_dataset_info(tmp_path)


def test_unreadable_files_name_the_file(tmp_path):
    """A corrupt or truncated archive is bad data, named by its path (not a bare LZMAError)."""
    import lzma

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "docs.jsonl.xz").write_bytes(b"not xz at all")
    with pytest.raises(DataError, match=r"docs\.jsonl\.xz: cannot read it \(LZMAError"):
        open_source(str(tmp_path / "bad")).count()
    (tmp_path / "cut").mkdir()
    whole = lzma.compress(("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(2000))).encode())
    (tmp_path / "cut" / "docs.jsonl.xz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"docs\.jsonl\.xz: cannot read it \(EOFError"):
        list(open_source(str(tmp_path / "cut")))


# -- the command lines: bad data is one line on stderr and exit status 2, as a bad recipe is --------


def _bad_sources(root):
    """(name, source directory or spec, what the message must say) for several kinds of bad data."""
    (root / "one").mkdir()
    (root / "one" / "only.txt").write_text("a single document")
    (root / "json").mkdir()
    (root / "json" / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{'text': 'single quotes'}\n")
    (root / "xz").mkdir()
    (root / "xz" / "a.txt.xz").write_bytes(b"\xfd7zXZ\x00 truncated")
    return [
        ("missing", str(root / "nowhere"), "no such file or directory"),
        ("too few", str(root / "one"), "holds 1 document(s); at least 2 are needed"),
        ("bad json", str(root / "json"), "a.jsonl:2: not a JSON line"),
        ("corrupt xz", str(root / "xz"), "a.txt.xz: cannot read it"),
    ]


def _one_line(err: str, prefix: str) -> str:
    """The error: stderr's last line, its only line from the command, with no traceback (a
    library may still warn at import, e.g. a CUDA build of torch on a machine without CUDA)."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [line for line in lines if line.startswith(prefix)] == lines[-1:], err
    return lines[-1]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_prepare_cli_reports_bad_data_in_one_line(tmp_path, capsys):
    from cce_parallel.data.prepare import main

    for name, source, message in _bad_sources(tmp_path):
        assert main(["--source", source, "--out", str(tmp_path / "out")]) == 2, name
        line = _one_line(capsys.readouterr().err, "cce-prepare-data:")
        assert line.startswith("cce-prepare-data: invalid data: ") and message in line, (name, line)


def test_train_cli_reports_bad_data_in_one_line(tmp_path, capsys, monkeypatch):
    """`cce-train --prepare-data` (and training, which prepares first) as `cce-train: invalid recipe:`."""
    pytest.importorskip("yaml")
    from cce_parallel.train.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    for name, source, message in _bad_sources(tmp_path):
        argv = ["--prepare-data", "--set", f"data.source={source}", f"data.dir={tmp_path / 'out'}"]
        assert main(argv) == 2, name
        line = _one_line(capsys.readouterr().err, "cce-train:")
        assert line.startswith("cce-train: invalid data: ") and message in line, (name, line)


def test_training_reports_bad_data_in_one_line(tmp_path):
    """Training prepares the data before torchrun starts its ranks: one line, not a report per rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("yaml")
    name, source, message = _bad_sources(tmp_path)[2]  # a bad JSON line
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=child_pythonpath(root), WANDB_MODE="disabled")
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, "-m", "cce_parallel.train", "--set", f"data.source={source}",
         f"data.dir={tmp_path / 'out'}", f"run.out_dir={tmp_path / 'runs'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_line(done.stderr, "cce-train:")
    assert line.startswith("cce-train: invalid data: ") and message in line, line
