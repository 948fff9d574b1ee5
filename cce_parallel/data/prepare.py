"""Tokenize raw text into megatron-core indexed datasets (.bin/.idx), split train / validation.

    python -m cce_parallel.data.prepare --source stdlib --out data/stdlib --vocab-size 4096
    python -m cce_parallel.data.prepare --source openwebtext --out data/owt --tokenizer hf:gpt2 \\
        --train-fraction 0.05 --valid-fraction 0.0025

The paper pretrains on 5 % of OpenWebText and reports validation perplexity on a disjoint,
held-out 0.25 %. Here both sets are drawn from one seeded permutation of the document indices
[0, N): the first ``round(N * valid_fraction)`` indices are validation, the next
``round(N * train_fraction)`` training (all the rest when ``train_fraction`` is None). So the
validation set depends only on N, the seed and its own fraction.

Steps: count the documents; one pass over the source writes the chosen documents (that pass
drops those shorter than ``min_document_chars``) to temporary files; the ``bpe`` tokenizer is
trained on the training documents; both splits are encoded, every document followed by the EOD
token, with megatron's ``IndexedDatasetBuilder``. ``out_dir`` then holds:

    train_text_document.{bin,idx}   valid_text_document.{bin,idx}
    tokenizer.json                  (bpe and hf: tokenizers; tiktoken encodings are named only)
    dataset.json                    the DatasetInfo, paths relative to out_dir
    megatron_cache/                 created later by GPTDataset for its sample indices

Preparing is idempotent: with a dataset.json of the same arguments it returns at once. Call it
on one process (e.g. global rank 0), then barrier: it is not safe to run twice at once on one
out_dir.
"""

import argparse
import json
import logging
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cce_parallel.data import DataError, import_megatron
from cce_parallel.data.info import INFO_NAME, DatasetInfo, load_dataset_info
from cce_parallel.data.sources import open_source
from cce_parallel.data.tokenizer import HFTokenizer, Tokenizer, check_spec, load_tokenizer, train_bpe

# Named, not __name__: run as ``python -m cce_parallel.data.prepare`` this module is __main__, and
# its lines would miss the "cce_parallel" logger that main() and the train job show.
logger = logging.getLogger("cce_parallel.data.prepare")

TRAIN_NAME = "train_text_document"
VALID_NAME = "valid_text_document"
TOKENIZER_NAME = "tokenizer.json"
CACHE_NAME = "megatron_cache"
_WORK_NAME = ".prepare-work"
_BATCH_DOCS = 512  # documents per tokenizer batch
_PROGRESS_S = 10.0  # a progress line at most this often in a long pass


def split_documents(
    n_documents: int, train_fraction: float | None, valid_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted document indices (train, valid): disjoint, from one seeded permutation of [0, N).

    Validation takes ``max(1, round(N * valid_fraction))`` documents; training takes
    ``max(1, round(N * train_fraction))``, or all the others when ``train_fraction`` is None.
    """
    _check_fractions(train_fraction, valid_fraction)
    n_valid = max(1, round(n_documents * valid_fraction))
    n_train = n_documents - n_valid if train_fraction is None else max(1, round(n_documents * train_fraction))
    if n_train < 1 or n_train + n_valid > n_documents:
        raise DataError(
            f"{n_documents} documents cannot give {n_valid} validation and {max(n_train, 1)} training documents"
        )
    perm = np.random.default_rng(seed).permutation(n_documents)
    return np.sort(perm[n_valid : n_valid + n_train]), np.sort(perm[:n_valid])


def _check_fractions(train_fraction, valid_fraction):
    if not 0.0 < valid_fraction < 1.0:
        raise DataError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    if train_fraction is not None and not 0.0 < train_fraction <= 1.0 - valid_fraction:
        raise DataError(
            f"train_fraction must be in (0, 1 - valid_fraction = {1.0 - valid_fraction:g}], got {train_fraction}"
        )


class _Spill:
    """Documents written to a temporary file (length-prefixed UTF-8) and read back in order."""

    def __init__(self, path: Path):
        self.path = path
        self.count = 0
        self._f = open(path, "wb")  # noqa: SIM115 - closed by close(), also on errors

    def write(self, text: str) -> None:
        data = text.encode("utf-8", errors="replace")
        self._f.write(struct.pack("<Q", len(data)))
        self._f.write(data)
        self.count += 1

    def close(self) -> None:
        self._f.close()  # idempotent

    def __iter__(self) -> Iterator[str]:
        with open(self.path, "rb") as f:
            while header := f.read(8):
                (n,) = struct.unpack("<Q", header)
                yield f.read(n).decode("utf-8")


def _import_builder():
    """megatron-core's writer of its indexed format (the .bin/.idx files its GPTDataset reads)."""
    try:
        indexed = import_megatron("megatron.core.datasets.indexed_dataset")
    except ImportError as err:
        raise ImportError(
            f"writing .bin/.idx files needs megatron-core ({err}): pip install 'megatron-core>=0.16.1,<0.20'"
        ) from None
    return indexed.DType, indexed.IndexedDatasetBuilder


def _write_indexed(docs: "_Spill", tok: Tokenizer, prefix: Path, name: str) -> tuple[int, int]:
    """Encode ``docs`` (the ``name`` split) into prefix.bin/.idx, EOD after each; return (documents, tokens)."""
    start = time.monotonic()
    logger.info("tokenizing the %s documents", name)
    DType, IndexedDatasetBuilder = _import_builder()
    dtype = DType.optimal_dtype(tok.vocab_size)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    n_docs = n_tokens = 0
    batch: list[str] = []
    shown = start

    def flush():
        nonlocal n_docs, n_tokens, shown
        for ids in tok.tokenize_batch(batch):
            ids.append(tok.eod)
            builder.add_document(ids, [len(ids)])
            n_tokens += len(ids)
        n_docs += len(batch)
        batch.clear()
        if time.monotonic() - shown > _PROGRESS_S:
            shown = time.monotonic()
            logger.info("tokenized %s of %s %s documents (%.0f s)", f"{n_docs:,}", f"{docs.count:,}", name, shown - start)

    for text in docs:
        batch.append(text)
        if len(batch) == _BATCH_DOCS:
            flush()
    if batch:
        flush()
    builder.finalize(str(prefix) + ".idx")
    logger.info("tokenized the %s documents: %s documents, %s tokens (%.1f s)", name, f"{n_docs:,}", f"{n_tokens:,}",
                time.monotonic() - start)
    return n_docs, n_tokens


def _arguments(
    source, tokenizer, vocab_size, train_fraction, valid_fraction, seed, max_documents, min_document_chars
):
    return {
        "source": source,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size if tokenizer == "bpe" else None,
        "train_fraction": train_fraction,
        "valid_fraction": valid_fraction,
        "seed": seed,
        "max_documents": max_documents,
        "min_document_chars": min_document_chars,
    }


def _existing(out: Path, args: dict, overwrite: bool) -> DatasetInfo | None:
    """The dataset already in ``out`` if it was prepared with ``args``; None to (re)build."""
    if not (out / INFO_NAME).is_file():
        return None
    info = load_dataset_info(out)
    files = [
        info.train_prefix + ".bin",
        info.train_prefix + ".idx",
        info.valid_prefix + ".bin",
        info.valid_prefix + ".idx",
    ]
    if info.tokenizer_path:
        files.append(info.tokenizer_path)
    complete = all(os.path.isfile(f) for f in files)
    if info.args == args and complete:
        return info
    if not overwrite:
        if info.args == args:
            missing = [f for f in files if not os.path.isfile(f)]
            raise DataError(
                f"{out} holds an incomplete dataset (missing {missing}); pass overwrite=True (--overwrite)"
            )
        diff = {k: (info.args.get(k), v) for k, v in args.items() if info.args.get(k) != v}
        raise DataError(
            f"{out} already holds a dataset prepared with other arguments (existing, requested): {diff}; "
            "choose another output directory or pass overwrite=True (--overwrite)"
        )
    return None


def prepare_dataset(
    source: str,
    out_dir,
    *,
    tokenizer: str = "bpe",
    vocab_size: int = 8192,
    train_fraction: float | None = None,
    valid_fraction: float = 0.0025,
    seed: int = 1234,
    max_documents: int | None = None,
    min_document_chars: int = 1,
    overwrite: bool = False,
) -> DatasetInfo:
    """Tokenize ``source`` into ``out_dir`` (see the module docstring); return its DatasetInfo.

    source: "stdlib" (offline default), "openwebtext", "hf:<dataset>[:<config>]" or a local
        directory / file of .txt, .jsonl, .parquet or .xz.
    tokenizer: "bpe" (trained here, ``vocab_size`` tokens), "hf:<name or path>", "tiktoken:<encoding>".
    max_documents: use only the first N documents of the source (before splitting).
    min_document_chars: drop chosen documents shorter than this once stripped of whitespace.
    overwrite: replace a dataset prepared with other arguments instead of raising.
    """
    t0 = time.monotonic()
    tokenizer = check_spec(tokenizer)
    _check_fractions(train_fraction, valid_fraction)
    if max_documents is not None and max_documents < 2:
        raise DataError(f"max_documents must be at least 2 (one train, one valid), got {max_documents}")
    if min_document_chars < 1:
        raise DataError(f"min_document_chars must be at least 1, got {min_document_chars}")
    if tokenizer == "bpe" and vocab_size < 258:
        raise DataError(f"vocab_size {vocab_size}: a byte-level BPE needs at least 258")
    src = open_source(source)
    out = Path(out_dir).expanduser().resolve()
    args = _arguments(
        src.spec,
        tokenizer,
        vocab_size,
        train_fraction,
        valid_fraction,
        seed,
        max_documents,
        min_document_chars,
    )
    info = _existing(out, args, overwrite)
    if info is not None:
        logger.info("%s holds this dataset already (%s training tokens)", out, f"{info.n_train_tokens:,}")
        return info

    _import_builder()  # fail before the long passes if megatron-core is missing
    tok = None if tokenizer == "bpe" else load_tokenizer(tokenizer)  # fail early on a bad name
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / INFO_NAME, out / TOKENIZER_NAME):
        stale.unlink(missing_ok=True)
    # Megatron's sample-index cache is keyed by paths and sizes, not content: never reuse it.
    shutil.rmtree(out / CACHE_NAME, ignore_errors=True)
    work = out / _WORK_NAME
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    spills = {}
    try:
        logger.info("preparing %s from %s (first use): counting the documents", out, src.spec)
        n_total = src.count(max_documents)
        if n_total < 2:
            raise DataError(f"source {src.spec!r} holds {n_total} document(s); at least 2 are needed")
        train_idx, valid_idx = split_documents(n_total, train_fraction, valid_fraction, seed)
        logger.info(
            "%s: %s documents (%.1f s); %s chosen for training, %s for validation",
            src.spec,
            f"{n_total:,}",
            time.monotonic() - t0,
            f"{len(train_idx):,}",
            f"{len(valid_idx):,}",
        )

        which = np.zeros(n_total, dtype=np.int8)  # 0: unused, 1: train, 2: valid
        which[train_idx] = 1
        which[valid_idx] = 2
        last = int(max(train_idx[-1], valid_idx[-1]))
        spills.update({1: _Spill(work / "train"), 2: _Spill(work / "valid")})
        dropped, start = 0, time.monotonic()
        shown = start
        for i, text in enumerate(src):
            if time.monotonic() - shown > _PROGRESS_S:
                shown = time.monotonic()
                logger.info("read %s of %s documents (%.0f s)", f"{i:,}", f"{last + 1:,}", shown - start)
            if which[i]:
                if len(text.strip()) >= min_document_chars:
                    spills[which[i]].write(text)
                else:
                    dropped += 1
            if i == last:  # read no further: a stream may be long
                break
        for spill in spills.values():
            spill.close()
        train, valid = spills[1], spills[2]
        if dropped:
            logger.info("dropped %d chosen documents shorter than %d characters", dropped, min_document_chars)
        logger.info("read the chosen documents (%.1f s)", time.monotonic() - start)
        for name, spill in (("training", train), ("validation", valid)):
            if spill.count == 0:
                raise DataError(
                    f"no {name} document left from {src.spec!r} (min_document_chars={min_document_chars}); "
                    "use more documents or a larger fraction"
                )

        tok_path = out / TOKENIZER_NAME
        if tokenizer == "bpe":
            logger.info("training a byte-level BPE of %d tokens on %d documents", vocab_size, train.count)
            start = time.monotonic()
            tok = train_bpe(train, vocab_size, path=tok_path, length=train.count)
            logger.info("trained the BPE (%.1f s)", time.monotonic() - start)
        elif isinstance(tok, HFTokenizer):
            tok.save(tok_path)  # training needs no network for it later
        else:
            tok_path = None
        n_train_docs, n_train_tokens = _write_indexed(train, tok, out / TRAIN_NAME, "training")
        n_valid_docs, n_valid_tokens = _write_indexed(valid, tok, out / VALID_NAME, "validation")
    finally:
        for spill in spills.values():
            spill.close()
        shutil.rmtree(work, ignore_errors=True)

    info = DatasetInfo(
        out_dir=str(out),
        train_prefix=str(out / TRAIN_NAME),
        valid_prefix=str(out / VALID_NAME),
        tokenizer=tokenizer,
        tokenizer_path=None if tok_path is None else str(tok_path),
        vocab_size=tok.vocab_size,
        eod_id=tok.eod,
        n_train_documents=n_train_docs,
        n_valid_documents=n_valid_docs,
        n_train_tokens=n_train_tokens,
        n_valid_tokens=n_valid_tokens,
        source=src.spec,
        args=args,
    )
    # dataset.json last, atomically: its presence means the dataset is complete.
    tmp = out / (INFO_NAME + ".tmp")
    tmp.write_text(json.dumps(info.to_json(), indent=2) + "\n")
    os.replace(tmp, out / INFO_NAME)
    logger.info("prepared %s in %.1f s: %s training and %s validation tokens, vocabulary %d", out,
                time.monotonic() - t0, f"{n_train_tokens:,}", f"{n_valid_tokens:,}", tok.vocab_size)
    return info


def summary(info: DatasetInfo) -> str:
    """A few lines describing a prepared dataset."""
    return "\n".join(
        [
            f"dataset   {info.out_dir}",
            f"source    {info.source}",
            f"tokenizer {info.tokenizer} (vocab {info.vocab_size:,}, eod {info.eod_id})"
            + (f" {info.tokenizer_path}" if info.tokenizer_path else ""),
            f"train     {info.n_train_documents:>12,} documents {info.n_train_tokens:>15,} tokens  {info.train_prefix}",
            f"valid     {info.n_valid_documents:>12,} documents {info.n_valid_tokens:>15,} tokens  {info.valid_prefix}",
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cce_parallel.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--source",
        default="stdlib",
        help="stdlib (default: offline), openwebtext, hf:<dataset>[:<config>], or a directory or file "
        "of .txt/.jsonl/.parquet/.xz",
    )
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument(
        "--tokenizer", default="bpe", help="bpe (default), hf:<name or path> or tiktoken:<encoding>"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=8192, help="vocabulary of the bpe tokenizer (default 8192)"
    )
    ap.add_argument(
        "--train-fraction", type=float, default=None, help="default: all documents not in validation"
    )
    ap.add_argument(
        "--valid-fraction", type=float, default=0.0025, help="default 0.0025 (the paper's 0.25 %%)"
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-documents", type=int, default=None, help="use only the first N documents")
    ap.add_argument("--min-document-chars", type=int, default=1)
    ap.add_argument(
        "--overwrite", action="store_true", help="replace a dataset prepared with other arguments"
    )
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("cce_parallel").setLevel(logging.INFO)
    try:
        info = prepare_dataset(
            a.source,
            a.out,
            tokenizer=a.tokenizer,
            vocab_size=a.vocab_size,
            train_fraction=a.train_fraction,
            valid_fraction=a.valid_fraction,
            seed=a.seed,
            max_documents=a.max_documents,
            min_document_chars=a.min_document_chars,
            overwrite=a.overwrite,
        )
    except DataError as err:
        print(f"cce-prepare-data: invalid data: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an optional package that this source or tokenizer needs
        print(f"cce-prepare-data: {err}", file=sys.stderr)
        return 2
    print(summary(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
