"""megatron-core GPT datasets over a prepared dataset (train and validation from their own files).

    info = load_dataset_info("data/stdlib")
    tok = load_tokenizer(info)
    train_ds, valid_ds = build_gpt_datasets(info, seq_length=1024, seed=1234, train_samples=steps * gbs,
                                            valid_samples=evals * eval_iters * gbs, tokenizer=tok)
    train_ds[i]  # {"tokens": [s], "labels": [s], "loss_mask": [s], "position_ids": [s], "attention_mask": [1, s, s]}

``BlendedMegatronDatasetBuilder`` builds with ``blend_per_split``: the train prefix feeds the
train split and the validation prefix the validation split, each whole (no split string). The
sample indices (document / sample / shuffle .npy files) are cached in ``out_dir/megatron_cache``.

Distributed use: call ``build_gpt_datasets`` on every rank of the default process group (gloo or
NCCL). Megatron builds on global rank 0 first, then ``torch.distributed.barrier()``, then the
other ranks load rank 0's cache, so ``out_dir`` must be on a filesystem every node sees. Ranks
whose ``is_built_on_rank()`` is False get None (Megatron-LM builds on TP rank 0 only).

Megatron's index building needs its compiled helpers (``megatron.core.datasets.helpers_cpp``).
The megatron-core wheels on PyPI ship them prebuilt; for a source install without them,
``ensure_helpers`` compiles ``helpers.cpp`` once (needs a C++ compiler and pybind11) into
``$CCE_PARALLEL_CACHE`` (default ``~/.cache/cce_parallel``). This module imports megatron lazily.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from cce_parallel.data import DataError, import_megatron
from cce_parallel.data.info import DatasetInfo
from cce_parallel.data.prepare import CACHE_NAME
from cce_parallel.data.tokenizer import Tokenizer, load_tokenizer

_HELPERS = "megatron.core.datasets.helpers_cpp"

def _import_megatron():
    try:
        import_megatron("megatron.core.datasets.gpt_dataset")
    except ImportError as err:
        raise ImportError(
            f"reading the datasets needs megatron-core ({err}): pip install 'megatron-core>=0.16.1,<0.20'"
        ) from None
    try:  # megatron-core >= 0.14: the abstract tokenizer GPTDatasetConfig is typed with
        from megatron.core.tokenizers import MegatronTokenizerBase

        MegatronTokenizerBase.register(Tokenizer)
    except ImportError:
        pass


def ensure_helpers() -> None:
    """Make ``megatron.core.datasets.helpers_cpp`` importable, compiling it if the install lacks it."""
    try:
        importlib.import_module(_HELPERS)
        return
    except ImportError as err:
        first_error = err
    import megatron.core.datasets as mcd

    source = Path(mcd.__file__).parent / "helpers.cpp"
    if not source.is_file():
        raise ImportError(f"{_HELPERS} is missing and {source} is not there to build it ({first_error})")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    try:
        import pybind11
    except ImportError:
        pybind11 = None
    if compiler is None or pybind11 is None:
        raise ImportError(
            f"{_HELPERS} is missing from this megatron-core install ({first_error}); building it needs "
            + (
                "a C++ compiler (apt-get install g++)"
                if compiler is None
                else "pybind11 (pip install pybind11)"
            )
            + " - or install megatron-core from its PyPI wheel, which ships it prebuilt"
        )
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    cache = Path(os.environ.get("CCE_PARALLEL_CACHE", Path.home() / ".cache" / "cce_parallel"))
    target = cache / "megatron_helpers" / f"helpers_cpp-{digest}{suffix}"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        # The flags of megatron's own Makefile. Ranks may compile at once: each writes its own
        # file and renames it into place atomically.
        cmd = [compiler, "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", f"-I{pybind11.get_include()}"]
        cmd += [f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"compiling megatron's dataset helpers failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}"
            )
        os.replace(tmp, target)
    spec = importlib.util.spec_from_file_location(_HELPERS, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_HELPERS] = module
    mcd.helpers_cpp = module


def gpt_dataset_config(
    info: DatasetInfo, *, seq_length: int, seed: int, tokenizer: Tokenizer | None = None, **overrides
):
    """megatron's ``GPTDatasetConfig`` for ``info``: train and validation prefixes per split.

    ``overrides`` are further GPTDatasetConfig fields (e.g. ``create_attention_mask=False`` where
    the attention kernel builds its own causal mask, ``num_dataset_builder_threads``).
    """
    _import_megatron()
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    tokenizer = load_tokenizer(info) if tokenizer is None else tokenizer
    if tokenizer.eod != info.eod_id or tokenizer.vocab_size != info.vocab_size:
        raise DataError(
            f"the tokenizer (vocab {tokenizer.vocab_size}, eod {tokenizer.eod}) is not the one {info.out_dir} "
            f"was written with (vocab {info.vocab_size}, eod {info.eod_id})"
        )
    for prefix in (info.train_prefix, info.valid_prefix):
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise DataError(f"{prefix + ext} does not exist: prepare the dataset again")
    fields = {
        "random_seed": seed,
        "sequence_length": seq_length,
        "blend_per_split": [([info.train_prefix], None), ([info.valid_prefix], None), None],
        "path_to_cache": os.path.join(info.out_dir, CACHE_NAME),
        "mmap_bin_files": True,
        "tokenizer": tokenizer,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
    }
    fields.update(overrides)
    return GPTDatasetConfig(**fields)


def build_gpt_datasets(
    info: DatasetInfo,
    *,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int | None,
    tokenizer: Tokenizer | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
    **config_overrides,
):
    """(train_ds, valid_ds): megatron ``GPTDataset``s of at least the requested sample counts.

    Each sample is ``seq_length`` tokens plus one (inputs and shifted labels), documents packed
    across EOD. A split smaller than requested is repeated in freshly shuffled epochs.
    ``valid_samples=None`` gives one epoch of validation. Call on every rank when distributed.
    """
    if seq_length < 1 or train_samples < 1 or (valid_samples is not None and valid_samples < 1):
        raise ValueError(
            f"seq_length {seq_length}, train_samples {train_samples}, valid_samples {valid_samples}"
        )
    config = gpt_dataset_config(
        info, seq_length=seq_length, seed=seed, tokenizer=tokenizer, **config_overrides
    )
    ensure_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], is_built_on_rank or (lambda: True), config
    )
    train_ds, valid_ds, _ = builder.build()
    return train_ds, valid_ds
