"""Tokenizers for pretraining data, with the interface megatron-core's GPT datasets read.

A tokenizer spec is one of:

| spec                    | tokenizer                                                          |
|-------------------------|--------------------------------------------------------------------|
| ``bpe``                 | a byte-level BPE trained with the ``tokenizers`` library on the training text, saved as ``tokenizer.json`` next to the data (``prepare_dataset`` trains it) |
| ``hf:<name or path>``   | a Hugging Face tokenizer: a ``tokenizer.json`` file, a local model directory, or a Hub name (online or in the HF cache) |
| ``tiktoken:<encoding>`` | a tiktoken encoding (``gpt2``, ``cl100k_base``, ``o200k_base``...) or model name (needs ``tiktoken``) |

``Tokenizer`` has what megatron-core's ``GPTDataset`` reads from ``GPTDatasetConfig.tokenizer``:
``vocab_size``, ``eod`` (appended after every document), ``unique_identifiers`` (part of the
index-cache key), and ``tokenize`` / ``detokenize``. It has no pad token, so megatron masks no
padding (none is written). It is registered as a virtual subclass of megatron's
``MegatronTokenizerBase`` by ``cce_parallel.data.megatron_data``; this module never imports megatron.

Raw text is encoded as ordinary text: a literal ``<|endoftext|>`` inside a document is not the
EOD token, which only ``prepare_dataset`` writes, by id, between documents.
"""

import collections
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from cce_parallel.data import DataError
from cce_parallel.data.info import load_dataset_info

BPE_EOD = "<|endoftext|>"
# End-of-text tokens of common Hugging Face tokenizers (GPT-2/Qwen/Phi, Llama 3, Llama 2/Mistral,
# Gemma): the first one in the vocabulary is the EOD, before the tokenizer's own eos.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_HELP = "use 'bpe', 'hf:<name or path>' or 'tiktoken:<encoding>'"


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("this tokenizer needs the `tokenizers` library: pip install tokenizers") from None
    return tokenizers


class Tokenizer:
    """Text <-> token ids. Use ``load_tokenizer`` or ``train_bpe`` to make one.

    Attributes: ``spec`` (how it was named), ``path`` (its file, or None), ``vocab_size``,
    ``eod`` (= ``eos``).
    """

    def __init__(self, spec: str, *, vocab_size: int, eod: int, path: str | None, fingerprint: str):
        self.spec = spec
        self.path = path
        self._vocab_size = int(vocab_size)
        self._eod = int(eod)
        self._fingerprint = fingerprint
        if not 0 <= self._eod < self._vocab_size:
            raise DataError(f"tokenizer {spec!r}: eod id {eod} is outside the vocabulary [0, {vocab_size})")

    # -- what megatron-core reads ------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The number of token ids (ids are in [0, vocab_size)), special tokens included."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The end-of-document id written after every document."""
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> collections.OrderedDict:
        """Identifies the tokenizer in megatron's index-cache key (JSON-serializable)."""
        return collections.OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("spec", self.spec),
                ("vocab_size", self._vocab_size),
                ("eod", self._eod),
                ("fingerprint", self._fingerprint),
            ]
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``, encoded as ordinary text (no special tokens added)."""
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens (EOD) are written out."""
        raise NotImplementedError

    @property
    def vocab(self) -> dict:
        """Token string -> id."""
        raise NotImplementedError

    @property
    def inv_vocab(self) -> dict:
        """Id -> token string."""
        return {i: t for t, i in self.vocab.items()}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is for pretraining text; it has no chat template")

    def __repr__(self):
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self._vocab_size}, eod={self._eod})"


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (byte-level BPE of ``bpe``, or any Hugging Face tokenizer.json)."""

    def __init__(self, tok, spec: str, *, eod: int, path: str | None = None):
        tok.encode_special_tokens = True  # documents are plain text: never match special tokens
        self._tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        fingerprint = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()[:16]
        super().__init__(spec, vocab_size=vocab_size, eod=eod, path=path, fingerprint=fingerprint)

    @classmethod
    def from_file(cls, path, spec: str | None = None, eod: int | str | None = None) -> "HFTokenizer":
        """Load a tokenizer.json; ``eod``: an id, or see ``_resolve_eod``."""
        tokenizers = _import_tokenizers()
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path))
        return cls(tok, spec or f"hf:{path}", eod=_resolve_eod(tok, eod, str(path)), path=str(path))

    def __getstate__(self):
        # The encode_special_tokens switch is not part of a tokenizers.Tokenizer's pickle.
        state = dict(self.__dict__)
        state["_tok"] = self._tok.to_str()
        return state

    def __setstate__(self, state):
        tokenizers = _import_tokenizers()
        self.__dict__.update(state)
        self._tok = tokenizers.Tokenizer.from_str(state["_tok"])
        self._tok.encode_special_tokens = True

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict:
        return self._tok.get_vocab(with_added_tokens=True)

    def save(self, path) -> None:
        """Write the tokenizer.json."""
        self._tok.save(str(path))


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding; EOD is its ``<|endoftext|>``."""

    def __init__(self, enc, spec: str):
        self._enc = enc
        super().__init__(spec, vocab_size=enc.n_vocab, eod=enc.eot_token, path=None, fingerprint=enc.name)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        vocab = {t.decode("utf-8", errors="replace"): i for t, i in self._enc._mergeable_ranks.items()}
        vocab.update(self._enc._special_tokens)
        return vocab


def _resolve_eod(tok, eod, where: str) -> int:
    """``eod`` if it is an id; else the first of EOD_CANDIDATES in the vocabulary, else the token
    ``eod`` names (the tokenizer's eos). End-of-text comes first: an instruct model's eos is often
    an end-of-turn token (Qwen's <|im_end|>, Llama 3's <|eot_id|>), not a document separator."""
    if isinstance(eod, int):
        return eod
    names = list(EOD_CANDIDATES) + ([eod] if eod else [])
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    raise DataError(
        f"tokenizer {where}: no end-of-document token among {names}; "
        "name it in the model directory's tokenizer_config.json (eos_token)"
    )


def _eos_from_config(directory: Path) -> str | None:
    import json

    cfg = directory / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    eos = json.loads(cfg.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _load_hf(name: str, spec: str) -> HFTokenizer:
    """``name``: a tokenizer.json, a local model directory, or a Hub name."""
    local_like = name.startswith(("/", ".", "~")) or name.endswith(".json")
    path = Path(name).expanduser()
    if path.is_file():
        return HFTokenizer.from_file(path, spec=spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer.from_file(path / "tokenizer.json", spec=spec, eod=_eos_from_config(path))
        return _load_transformers(str(path), spec)
    if local_like:
        raise DataError(f"tokenizer {spec!r}: no such file or directory {str(path)!r}")
    # A Hub name: through transformers when installed (it reads the HF cache and handles tokenizers
    # shipped without tokenizer.json), else the tokenizers library's own download.
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        return _load_transformers(name, spec)
    tokenizers = _import_tokenizers()
    try:
        tok = tokenizers.Tokenizer.from_pretrained(name)
    except Exception as err:
        raise DataError(
            f"tokenizer {spec!r}: {name!r} is not a local file or directory, and fetching its tokenizer.json "
            f"from the Hugging Face Hub failed ({type(err).__name__}: {err}). Give a local tokenizer.json or "
            "model directory, check the network, or `pip install transformers` to use the HF cache."
        ) from err
    return HFTokenizer(tok, spec, eod=_resolve_eod(tok, None, name))


def _load_transformers(name: str, spec: str) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(
            f"tokenizer {spec!r}: {name!r} has no tokenizer.json, so loading it needs transformers: "
            "pip install transformers"
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(name)
    except Exception as err:
        raise DataError(
            f"tokenizer {spec!r}: transformers could not load {name!r} ({type(err).__name__}: {err}). "
            "Check the name, the network or HF_HUB_OFFLINE and the HF cache."
        ) from err
    if not getattr(auto, "is_fast", False):
        raise DataError(f"tokenizer {spec!r}: only fast (Rust) tokenizers are supported; {name!r} is slow")
    tok = auto.backend_tokenizer
    return HFTokenizer(tok, spec, eod=_resolve_eod(tok, auto.eos_token, name))


def _load_tiktoken(name: str, spec: str) -> TiktokenTokenizer:
    try:
        import tiktoken
    except ImportError:
        raise ImportError(f"tokenizer {spec!r} needs tiktoken: pip install tiktoken") from None
    try:
        enc = tiktoken.get_encoding(name)
    except ValueError:
        try:
            enc = tiktoken.encoding_for_model(name)
        except KeyError:
            raise DataError(f"tokenizer {spec!r}: tiktoken knows no encoding or model {name!r}") from None
    except Exception as err:
        raise DataError(
            f"tokenizer {spec!r}: tiktoken could not load {name!r} ({type(err).__name__}: {err}). Its BPE file "
            "is downloaded once and cached in $TIKTOKEN_CACHE_DIR; offline, copy the cache there."
        ) from err
    return TiktokenTokenizer(enc, spec)


def check_spec(spec: str) -> str:
    """Raise DataError unless ``spec`` is a tokenizer spec; return it."""
    spec = str(spec)
    if spec == "bpe" or (spec.startswith(("hf:", "tiktoken:")) and spec.split(":", 1)[1]):
        return spec
    raise DataError(f"unknown tokenizer {spec!r}: {TOKENIZER_HELP}")


def load_tokenizer(info_or_spec) -> Tokenizer:
    """The tokenizer of a prepared dataset, or one named by a spec.

    ``info_or_spec``: a ``DatasetInfo``; a prepared dataset directory (with dataset.json); a
    tokenizer.json path; or a spec ``hf:<name or path>`` / ``tiktoken:<encoding>``. The spec
    ``bpe`` alone names no tokenizer: ``prepare_dataset`` trains one per dataset.
    """
    if hasattr(info_or_spec, "tokenizer_path"):  # a DatasetInfo
        info = info_or_spec
        if info.tokenizer_path:
            return HFTokenizer.from_file(info.tokenizer_path, spec=info.tokenizer, eod=info.eod_id)
        tok = load_tokenizer(info.tokenizer)
        if tok.eod != info.eod_id or tok.vocab_size != info.vocab_size:
            raise DataError(
                f"tokenizer {info.tokenizer!r} loads with vocab {tok.vocab_size} / eod {tok.eod}, but the data in "
                f"{info.out_dir} was written with vocab {info.vocab_size} / eod {info.eod_id}"
            )
        return tok
    spec = os.fspath(info_or_spec)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "dataset.json").is_file():
        return load_tokenizer(load_dataset_info(path))
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer.from_file(path)
    if spec == "bpe":
        raise DataError(
            "the tokenizer 'bpe' is trained per dataset by prepare_dataset: pass its DatasetInfo, "
            "its directory or its tokenizer.json"
        )
    check_spec(spec)
    kind, name = spec.split(":", 1)
    return _load_hf(name, spec) if kind == "hf" else _load_tiktoken(name, spec)


def train_bpe(texts: Iterable[str], vocab_size: int, *, path=None, length: int | None = None) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenization, ``<|endoftext|>`` = id 0) on ``texts``.

    Every byte has a token, so any text encodes and decodes back exactly. The vocabulary may end
    up smaller than ``vocab_size`` on little text. Written to ``path`` (tokenizer.json) if given.
    """
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise DataError(
            f"vocab_size {vocab_size}: a byte-level BPE needs at least 258 (256 bytes, EOD, one merge)"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BPE_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    if path is not None:
        tok.save(str(path))
    return HFTokenizer(tok, "bpe", eod=tok.token_to_id(BPE_EOD), path=None if path is None else str(path))
