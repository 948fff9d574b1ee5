"""Small real-text corpora written in each local source format, and a prepared dataset."""

import json
import lzma
import tarfile

import pytest


def corpus() -> list[str]:
    """About 50 documents: Python reference topics (real English) plus awkward edge cases."""
    from pydoc_data.topics import topics

    docs = list(dict.fromkeys(topics[k][:1500] for k in sorted(topics)))[:44]  # some topics repeat
    docs += [
        "Grüße aus Köln — naïve café, 東京, Ελληνικά, emoji 🙂🚀.",
        "  leading spaces, trailing tabs\t\t\nand\r\nWindows newlines\r\n",
        "A literal <|endoftext|> inside a document is ordinary text.",
        "x",
        "line one\n\n\nline four after blank lines\n",
        "def f(x):\n    return x ** 2  # code, indented\n",
    ]
    return docs


def write_corpus(directory, docs, fmt: str):
    """Write docs under directory as fmt: txt, jsonl, parquet, tar.xz, jsonl.xz or txt.xz."""
    directory.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    if fmt == "txt":  # one file per document, in two subdirectories (sorted walk keeps the order)
        for i, doc in enumerate(docs):
            sub = directory / ("a" if i < half else "b")
            sub.mkdir(exist_ok=True)
            (sub / f"{i:04d}.txt").write_bytes(doc.encode("utf-8"))
    elif fmt == "jsonl":  # two files, with a blank line that must be skipped
        for name, part in (("part0.jsonl", docs[:half]), ("part1.jsonl", docs[half:])):
            lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(part)]
            (directory / name).write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), directory / "docs.parquet", row_group_size=7)
    elif fmt == "tar.xz":  # OpenWebText's layout: tar archives of .txt files, xz-compressed
        import io

        for name, part in (
            ("urlsf_subset00-1_data.xz", docs[:half]),
            ("urlsf_subset00-2_data.xz", docs[half:]),
        ):
            with tarfile.open(directory / name, "w:xz") as tar:
                for i, doc in enumerate(part):
                    data = doc.encode("utf-8")
                    member = tarfile.TarInfo(f"{i:07d}-abc.txt")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    elif fmt == "jsonl.xz":
        with lzma.open(directory / "docs.jsonl.xz", "wt", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    elif fmt == "txt.xz":
        for i, doc in enumerate(docs):
            with lzma.open(directory / f"{i:04d}.txt.xz", "wb") as f:
                f.write(doc.encode("utf-8"))
    else:
        raise ValueError(fmt)
    return directory


@pytest.fixture(scope="session")
def docs():
    return corpus()


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A dataset prepared once from the txt corpus (bpe, 10 % validation) for the reading tests."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("megatron.core")
    from cce_parallel.data import prepare_dataset

    root = tmp_path_factory.mktemp("prepared")
    docs = [f"{copy}. {doc}" for copy in range(4) for doc in corpus()]  # distinct documents
    src = write_corpus(root / "src", docs, "txt")
    return prepare_dataset(str(src), root / "out", vocab_size=400, valid_fraction=0.1, seed=7)
