"""Raw-text sources for dataset preparation.

A source yields its documents as strings, in the same order on every pass, and can count them.
The train/validation split is then a set of document indices (see ``prepare.split_documents``),
so it is reproducible from the seed alone.

| spec                    | documents                                                             |
|-------------------------|-----------------------------------------------------------------------|
| ``stdlib``              | the Python language reference topics (``pydoc_data``), then the docstrings of every stdlib module, read with ``ast`` (nothing is imported); offline, on every machine |
| ``openwebtext``         | ``hf:Skylion007/openwebtext``                                         |
| ``hf:<name>[:<config>]``| the ``train`` split's ``text`` column of a Hugging Face dataset, streamed (needs ``datasets``) |
| a directory or a file   | ``.txt`` (one file, one document), ``.jsonl`` (one JSON object with a ``text`` field per line), ``.parquet`` (column ``text``, needs ``pyarrow``), ``.xz`` (a tar archive such as OpenWebText's ``urlsf_subset*.xz``: one member, one document; ``*.jsonl.xz``: JSON lines; otherwise the whole file is one document) |

A directory is walked recursively in sorted order; hidden entries and other suffixes are skipped.
Documents may be empty: the caller filters them *after* choosing the split, so that indices stay
aligned with ``count()``.
"""

import ast
import contextlib
import itertools
import json
import lzma
import os
import sysconfig
import tarfile
from collections.abc import Iterator
from pathlib import Path

from cce_parallel.data import DataError

OPENWEBTEXT = "Skylion007/openwebtext"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet", ".xz")
SOURCE_HELP = (
    "expected 'stdlib', 'openwebtext', 'hf:<dataset name>' or a directory of "
    + "/".join(LOCAL_SUFFIXES)
    + " files"
)


class Source:
    """Documents in a fixed order. ``spec`` is the normalized source string."""

    spec: str

    def count(self, limit: int | None = None) -> int:
        """The number of documents, at most ``limit`` (counting may stop there)."""
        return sum(1 for _ in itertools.islice(iter(self), limit))

    def __iter__(self) -> Iterator[str]:
        raise NotImplementedError


def open_source(spec: str) -> Source:
    """The source that ``spec`` names (see the module docstring)."""
    spec = str(spec)
    if spec == "stdlib":
        return StdlibSource()
    if spec == "openwebtext":
        return HFSource(OPENWEBTEXT)
    if spec.startswith("hf:"):
        name, _, config = spec[3:].partition(":")
        if not name:
            raise DataError(f"source {spec!r}: no dataset name after 'hf:'")
        return HFSource(name, config or None)
    path = Path(spec).expanduser()
    if path.exists():
        return LocalSource(path)
    raise DataError(f"source {spec!r}: no such file or directory; {SOURCE_HELP}")


# --------------------------------------------------------------------------------------------
# The Python standard library


class StdlibSource(Source):
    """Reference topics and docstrings of the running Python's standard library.

    The text depends only on the Python installation, so the same interpreter gives the same
    documents in the same order. Parsing every module takes a few seconds, so documents are
    produced lazily and kept for the next pass.
    """

    spec = "stdlib"
    _SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

    def __init__(self):
        self._docs: list[str] = []
        self._gen = self._generate()

    def _files(self) -> list[Path]:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in self._SKIP_DIRS and not d.startswith("."))
            files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
        # pydoc_data/topics.py is read through its module below, not as a docstring source.
        return [f for f in files if f.name != "topics.py" or f.parent.name != "pydoc_data"]

    def _generate(self) -> Iterator[str]:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # some distributions strip it
            topics = {}
        for key in sorted(topics):
            yield topics[key]
        for path in self._files():
            try:
                tree = ast.parse(path.read_bytes(), filename=str(path))
            except (SyntaxError, ValueError, OSError):
                continue  # e.g. lib2to3 test data written in Python 2
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=True)
                    if doc:
                        yield doc

    def __iter__(self) -> Iterator[str]:
        yield from self._docs
        for doc in self._gen:
            self._docs.append(doc)
            yield doc


# --------------------------------------------------------------------------------------------
# Local files


def _is_tar_xz(path: Path) -> bool:
    with lzma.open(path, "rb") as f:
        head = f.read(512)
    return len(head) == 512 and head[257:262] == b"ustar"


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _jsonl_texts(lines, where: str) -> Iterator[str]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}:{lineno}: not a JSON line ({err})") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise DataError(f"{where}:{lineno}: expected a JSON object with a 'text' field")
        yield obj["text"] or ""


def _count_jsonl(lines) -> int:
    return sum(1 for line in lines if line.strip())


def _import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet files needs pyarrow: pip install pyarrow") from None
    return pq


class LocalSource(Source):
    """Documents from a directory of (or a single) .txt, .jsonl, .parquet or .xz files."""

    def __init__(self, path: Path):
        path = Path(path).expanduser().resolve()
        self.spec = str(path)
        if path.is_file():
            if not path.name.endswith(LOCAL_SUFFIXES):
                raise DataError(f"source {self.spec!r}: unsupported file type; {SOURCE_HELP}")
            self.files = [path]
        else:
            self.files = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                self.files += [
                    Path(dirpath, f)
                    for f in sorted(filenames)
                    if f.endswith(LOCAL_SUFFIXES) and not f.startswith(".")
                ]
            if not self.files:
                raise DataError(
                    f"source {self.spec!r}: the directory holds no file to read; {SOURCE_HELP}"
                )

    @staticmethod
    def _kind(path: Path) -> str:
        name = path.name
        if name.endswith(".xz"):
            if name.endswith(".jsonl.xz"):
                return "jsonl.xz"
            return "tar.xz" if _is_tar_xz(path) else "text.xz"
        return path.suffix[1:]

    def _count_file(self, path: Path) -> int:
        kind = self._kind(path)
        if kind == "txt" or kind == "text.xz":
            return 1
        if kind == "jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                return _count_jsonl(f)
        if kind == "jsonl.xz":
            with lzma.open(path, "rt", encoding="utf-8", errors="replace") as f:
                return _count_jsonl(f)
        if kind == "parquet":
            return _import_pyarrow_parquet().ParquetFile(path).metadata.num_rows
        with tarfile.open(path, "r|xz") as tar:  # tar.xz: a full decompression pass
            return sum(1 for member in tar if member.isfile())

    def _iter_file(self, path: Path) -> Iterator[str]:
        kind = self._kind(path)
        if kind == "txt":
            yield _decode(path.read_bytes())
        elif kind == "text.xz":
            with lzma.open(path, "rb") as f:
                yield _decode(f.read())
        elif kind == "jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from _jsonl_texts(f, str(path))
        elif kind == "jsonl.xz":
            with lzma.open(path, "rt", encoding="utf-8", errors="replace") as f:
                yield from _jsonl_texts(f, str(path))
        elif kind == "parquet":
            pf = _import_pyarrow_parquet().ParquetFile(path)
            if "text" not in pf.schema_arrow.names:
                raise DataError(f"{path}: no 'text' column (columns: {pf.schema_arrow.names})")
            for batch in pf.iter_batches(columns=["text"]):
                for text in batch.column(0).to_pylist():
                    yield text or ""
        else:  # tar.xz, streamed member by member
            with tarfile.open(path, "r|xz") as tar:
                for member in tar:
                    if member.isfile():
                        yield _decode(tar.extractfile(member).read())

    def count(self, limit: int | None = None) -> int:
        total = 0
        for path in self.files:
            with _reading(path):
                total += self._count_file(path)
            if limit is not None and total >= limit:
                return limit
        return total

    def __iter__(self) -> Iterator[str]:
        for path in self.files:
            with _reading(path):
                yield from self._iter_file(path)


@contextlib.contextmanager
def _reading(path: Path):
    """A file that cannot be read (truncated or corrupt archive, no permission, ...) is a DataError."""
    try:
        yield
    except DataError:
        raise
    except (OSError, EOFError, ValueError, lzma.LZMAError, tarfile.TarError) as err:
        raise DataError(f"{path}: cannot read it ({type(err).__name__}: {err})") from err


# --------------------------------------------------------------------------------------------
# Hugging Face datasets


class HFSource(Source):
    """The ``text`` column of a Hugging Face dataset's ``train`` split, streamed.

    The number of documents comes from the dataset card when it has one; otherwise ``count``
    streams the dataset once. Datasets that only have a loading script (as OpenWebText had) do
    not load with ``datasets`` >= 4; then the Hub's Parquet conversion is tried.
    """

    def __init__(self, name: str, config: str | None = None, split: str = "train", column: str = "text"):
        self.name, self.config, self.split, self.column = name, config, split, column
        self.spec = f"hf:{name}" + (f":{config}" if config else "")
        self._ds = None

    def _dataset(self):
        if self._ds is not None:
            return self._ds
        try:
            import datasets
        except ImportError:
            raise ImportError(
                f"the source {self.spec!r} needs the Hugging Face `datasets` library: pip install datasets "
                "(or download the data and pass its directory as the source)"
            ) from None
        errors = []
        for revision in (None, "refs/convert/parquet"):
            try:
                self._ds = datasets.load_dataset(
                    self.name, self.config, split=self.split, streaming=True, revision=revision
                )
                break
            except Exception as err:  # noqa: BLE001 - reported below with the other attempt
                errors.append(f"revision {revision or 'main'}: {type(err).__name__}: {err}")
        else:
            raise DataError(
                f"could not load the Hugging Face dataset {self.name!r} (split {self.split!r}):\n  "
                + "\n  ".join(errors)
                + "\nCheck the name and the network (HF_HUB_OFFLINE, HF_ENDPOINT), or download the data "
                "and pass its directory as the source (.txt/.jsonl/.parquet/.xz files)."
            )
        return self._ds

    def count(self, limit: int | None = None) -> int:
        ds = self._dataset()
        splits = getattr(getattr(ds, "info", None), "splits", None) or {}
        known = getattr(splits.get(self.split), "num_examples", None)
        if known:
            return known if limit is None else min(known, limit)
        return super().count(limit)  # one streaming pass

    def __iter__(self) -> Iterator[str]:
        for example in self._dataset():
            if self.column not in example:
                raise DataError(f"dataset {self.name!r} has no column {self.column!r}: {sorted(example)}")
            yield example[self.column] or ""
