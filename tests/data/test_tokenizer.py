"""Tokenizers: exact round trips, EOD handling, pickling, loading by every route."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from cce_parallel.data import load_tokenizer, train_bpe
from tests.data.conftest import corpus

AWKWARD = [
    "",
    " ",
    "plain ascii",
    "  two leading spaces and a trailing one ",
    "tabs\tand\nnewlines\r\n\n",
    "Grüße 東京 Ελληνικά 🙂🚀 \u200b zero-width \ufeff bom",
    "a literal <|endoftext|> token",
    "\x00 control \x1b[0m chars",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(corpus(), 400, path=path)


def test_bpe_round_trips_any_text(bpe):
    assert bpe.eod == 0 and bpe.vocab_size == 400 and bpe.eos == bpe.eod
    for text in AWKWARD + corpus():
        ids = bpe.tokenize(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.detokenize(ids) == text
    # The literal string is ordinary text; only prepare_dataset writes the EOD id.
    assert bpe.eod not in bpe.tokenize("a literal <|endoftext|> token")
    assert bpe.detokenize([bpe.eod]) == "<|endoftext|>"
    assert bpe.tokenize_batch(AWKWARD) == [bpe.tokenize(t) for t in AWKWARD]


def test_bpe_training_is_deterministic(tmp_path, bpe):
    again = train_bpe(corpus(), 400, path=tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == Path(bpe.path).read_text()
    assert again.unique_identifiers == bpe.unique_identifiers


def test_pickle_keeps_plain_text_encoding(bpe):
    clone = pickle.loads(pickle.dumps(bpe))
    for text in AWKWARD:
        assert clone.tokenize(text) == bpe.tokenize(text)


def test_unique_identifiers_are_json_and_distinguish_tokenizers(bpe):
    other = train_bpe(corpus(), 350)
    a, b = json.dumps(bpe.unique_identifiers), json.dumps(other.unique_identifiers)
    assert a != b and "fingerprint" in a


def test_load_routes_agree(bpe):
    by_path = load_tokenizer(bpe.path)
    by_spec = load_tokenizer(f"hf:{bpe.path}")
    text = AWKWARD[5]
    assert by_path.tokenize(text) == by_spec.tokenize(text) == bpe.tokenize(text)
    assert by_path.eod == by_spec.eod == bpe.eod  # found by name: <|endoftext|>
    assert by_spec.spec == f"hf:{bpe.path}"


def test_megatron_sees_a_tokenizer(bpe):
    pytest.importorskip("megatron.core")
    from megatron.core.tokenizers import MegatronTokenizerBase

    import cce_parallel.data.megatron_data as md

    md._import_megatron()
    assert isinstance(bpe, MegatronTokenizerBase)


def test_importing_the_package_needs_no_megatron():
    code = (
        "import sys, cce_parallel.data\n"
        "from cce_parallel.data import prepare, tokenizer, sources, megatron_data\n"
        "assert 'megatron' not in sys.modules and 'tokenizers' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2])
    )


def _model_dir(path, vocab, eos=None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if eos:
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return f"hf:{path}"


def test_eod_prefers_end_of_text_over_an_end_of_turn_eos(tmp_path):
    base = {"[UNK]": 0, "hello": 1, "<|im_end|>": 2}
    # Only the configured eos exists: it is the EOD.
    assert load_tokenizer(_model_dir(tmp_path / "a", base, eos="<|im_end|>")).eod == 2
    # An instruct model's eos is end-of-turn; the document separator is <|endoftext|>.
    both = dict(base, **{"<|endoftext|>": 3})
    assert load_tokenizer(_model_dir(tmp_path / "b", both, eos="<|im_end|>")).eod == 3
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(_model_dir(tmp_path / "c", {"[UNK]": 0, "hello": 1}))
