"""Pretraining data: tokenizers, dataset preparation (.bin/.idx) and megatron-core GPT datasets.

    python -m cce_parallel.data.prepare --source stdlib --out data/stdlib --vocab-size 4096

Importing this package needs neither megatron-core nor ``tokenizers``; the functions that use
them import them and say what to install when they are missing. Names are resolved on first
use, so that ``python -m cce_parallel.data.prepare`` does not import its module twice.

Bad input (a missing or unreadable source, too few documents, a bad JSON line, an unknown
tokenizer, a dataset directory prepared otherwise, ...) raises ``DataError``, whose message says
what is wrong and where; the command lines print it as one line.
"""

import importlib
import warnings


class DataError(ValueError):
    """The data or the arguments that name it are wrong (not a bug here): the message says how."""


# What megatron-core's package import warns on a machine without Transformer Engine and apex (four
# lines on a CPU install: its optimizer, clip_grads and Megatron-FSDP modules each fall back; 0.19
# also misses absl). The data code uses none of those modules.
_IMPORT_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "absl.logging is not installed")


def import_megatron(module: str):
    """``importlib.import_module(module)`` for a megatron-core module (prepare.py writes megatron's
    indexed format, megatron_data.py reads it), without the warnings of megatron.core's first
    import; the caller's warning filters are restored."""
    with warnings.catch_warnings():
        for message in _IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        return importlib.import_module(module)


_EXPORTS = {
    "DatasetInfo": "info",
    "load_dataset_info": "info",
    "prepare_dataset": "prepare",
    "split_documents": "prepare",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe": "tokenizer",
    "build_gpt_datasets": "megatron_data",
    "gpt_dataset_config": "megatron_data",
}

__all__ = ["DataError", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
