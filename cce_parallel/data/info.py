"""What a prepared dataset directory holds (dataset.json): ``DatasetInfo`` and its loader.

prepare.py writes it, tokenizer.py and the train job read it; this module imports neither of
them, so that the two do not import each other.
"""

import dataclasses
import json
import os
from pathlib import Path

from cce_parallel.data import DataError

INFO_NAME = "dataset.json"


@dataclasses.dataclass
class DatasetInfo:
    """A prepared dataset. Paths are absolute here and relative to out_dir in dataset.json."""

    out_dir: str
    train_prefix: str  # megatron path prefix: train_prefix + ".bin" / ".idx"
    valid_prefix: str
    tokenizer: str  # the spec: "bpe", "hf:<name or path>" or "tiktoken:<encoding>"
    tokenizer_path: str | None  # tokenizer.json in out_dir, or None (tiktoken)
    vocab_size: int  # the tokenizer's, special tokens included (not padded for TP)
    eod_id: int
    n_train_documents: int
    n_valid_documents: int
    n_train_tokens: int  # EOD tokens included
    n_valid_tokens: int
    source: str  # normalized source spec (a local directory as an absolute path)
    args: dict  # the prepare_dataset arguments that define the data

    _PATH_FIELDS = ("train_prefix", "valid_prefix", "tokenizer_path")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("out_dir")
        for key in self._PATH_FIELDS:
            if d[key] is not None:
                d[key] = os.path.relpath(d[key], self.out_dir)
        return d

    @classmethod
    def from_json(cls, d: dict, out_dir) -> "DatasetInfo":
        out_dir = Path(out_dir).resolve()
        d = dict(d, out_dir=str(out_dir))
        for key in cls._PATH_FIELDS:
            if d.get(key) is not None:
                d[key] = str(out_dir / d[key])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def load_dataset_info(out_dir) -> DatasetInfo:
    """The DatasetInfo of a directory written by ``prepare_dataset``."""
    path = Path(out_dir) / INFO_NAME
    if not path.is_file():
        raise DataError(
            f"{path} does not exist: prepare the dataset first (python -m cce_parallel.data.prepare --out {out_dir})"
        )
    try:
        return DatasetInfo.from_json(json.loads(path.read_text()), path.parent)
    except (ValueError, TypeError, AttributeError) as err:
        what = f"{type(err).__name__}: {err}"
        raise DataError(f"{path} is not a dataset description ({what}): prepare the dataset again") from None
