"""The bundled tokenizer and titan's BOS/EOS handling."""

import json

import pytest

from titan.components.data.tokenizer import Tokenizer, TokenizerError
from titan.runtime.paths import REPO_ROOT

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
    assert str(missing) in msg and "does not exist" in msg and "model.tokenizer_path" in msg
    # a model folder the configs name under assets/hf/: fetched from the hub
    with pytest.raises(
        TokenizerError,
        match=r"tokenizer 'assets/hf/Qwen3-8B' does not exist; "
        r"fetch the model's tokenizer with `python scripts/download_hf_assets\.py "
        r"--repo Qwen/Qwen3-8B`",
    ):
        Tokenizer("assets/hf/Qwen3-8B")


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match=r"holds no tokenizer\.json \(it is empty\)"):
        Tokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"holds no tokenizer\.json \(it holds config\.json\)"):
        Tokenizer(str(tmp_path))


def test_tokenizer_config_names_specials(tmp_path):
    """An HF model folder's tokenizer_config.json decides BOS/EOS."""
    src = json.loads((REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(src))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|pad|>"}, "eos_token": "<|begin_of_text|>"})
    )
    tok = Tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id) == (2, 0)


def test_a_long_document_is_encoded_in_pieces_to_the_same_tokens(tokenizer, monkeypatch):
    """The tokenizer's memory grows with the text it is handed (9 GiB for a 50 MB line): a
    document longer than PIECE_CHARS goes in pieces cut before a space between words, which
    byte-level BPE encodes to the whole text's tokens."""
    from titan.components.data import tokenizer as tok_mod

    text = (REPO_ROOT / "assets" / "corpus" / "kjv_valid.jsonl").read_text()[:60000]
    whole = tokenizer.encode(text)
    handed, real = [], tokenizer._tok

    class Spy:
        def encode(self, t, **kw):
            handed.append(len(t))
            return real.encode(t, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(tok_mod, "PIECE_CHARS", 4000)
    monkeypatch.setattr(tokenizer, "_tok", Spy())
    split = tokenizer.encode(text)
    assert len(handed) >= 14 and max(handed) <= 2 * 4000
    assert list(split) == whole
    assert [list(x) for x in tokenizer.encode_batch(["a b", text, "c"])] == [
        tokenizer.encode("a b"),
        whole,
        tokenizer.encode("c"),
    ]
    # without a space for a piece's length, the cut falls mid-word, still bounded
    assert [len(p) for p in tok_mod.pieces("x" * 10, 4)] == [4, 4, 2]
