"""The bundled tokenizer and titan's BOS/EOS handling."""

import json

import pytest

from titan.components.data.tokenizer import Tokenizer, TokenizerError
from titan.paths import REPO_ROOT

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  leading spaces, trailing space \n\nand\ttabs ",
    "Ünïcödé: naïve café, 日本語, emoji 🙂, Ελληνικά",
    "",
]


def test_vocab_and_specials(tokenizer):
    assert tokenizer.vocab_size == 2048
    assert tokenizer.bos_id == 0
    assert tokenizer.eos_id == 1
    assert tokenizer.decode([0]) == "<|begin_of_text|>"
    assert tokenizer.decode([1]) == "<|end_of_text|>"


def test_folder_path_and_repo_relative_path():
    by_folder = Tokenizer(str(REPO_ROOT / "assets" / "tokenizer"))
    assert by_folder.path.name == "tokenizer.json" and by_folder.vocab_size == 2048
    # relative paths resolve against the repo when not found in the working directory
    assert Tokenizer("assets/tokenizer/tokenizer.json").vocab_size == 2048


@pytest.mark.parametrize("text", TEXTS[:3])
def test_bos_eos_added_exactly_once(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert ids.count(tokenizer.bos_id) == 1 and ids.count(tokenizer.eos_id) == 1
    bare = tokenizer.encode(text, bos=False, eos=False)
    assert ids[1:-1] == bare
    assert tokenizer.bos_id not in bare and tokenizer.eos_id not in bare
    assert tokenizer.encode(text, bos=True, eos=False) == [tokenizer.bos_id] + bare
    assert tokenizer.encode(text, bos=False, eos=True) == bare + [tokenizer.eos_id]


def test_empty_text(tokenizer):
    assert tokenizer.encode("") == [tokenizer.bos_id, tokenizer.eos_id]
    assert tokenizer.encode("", bos=False, eos=False) == []


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert all(0 <= i < 2048 for i in ids)
    assert tokenizer.decode(ids) == text


def test_compresses_corpus_text(tokenizer):
    text = TEXTS[0]
    assert len(tokenizer.encode(text, bos=False, eos=False)) < len(text) / 2


def test_encode_batch_matches_encode(tokenizer):
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]
    assert tokenizer.encode_batch(TEXTS, bos=False, eos=False) == [
        tokenizer.encode(t, bos=False, eos=False) for t in TEXTS
    ]


def test_decode_skip_special(tokenizer):
    ids = tokenizer.encode("the earth")
    assert tokenizer.decode(ids, skip_special=True) == "the earth"
    assert tokenizer.decode(ids) == "<|begin_of_text|>the earth<|end_of_text|>"


def test_missing_file(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(TokenizerError) as e:
        Tokenizer(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "not found" in msg and "model.tokenizer_path" in msg


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer(str(tmp_path))


def test_tokenizer_config_names_specials(tmp_path):
    """An HF model folder's tokenizer_config.json decides BOS/EOS."""
    src = json.loads((REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(src))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|pad|>"}, "eos_token": "<|begin_of_text|>"}))
    tok = Tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id) == (2, 0)
