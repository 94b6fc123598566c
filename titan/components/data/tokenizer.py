"""HF `tokenizers` tokenizer.json loader with explicit BOS/EOS handling."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from titan.runtime.paths import resolve

# names used by Llama 3, GPT-2 style and SentencePiece-converted tokenizers, in that order
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>")


# a document longer than this is encoded in pieces: the tokenizer's working memory grows
# with the text it is given (~180 bytes a character: 9 GiB for a 50 MB line), a piece's not
PIECE_CHARS = 1 << 20
# where a piece may end: before a single space between two words. Byte-level BPE
# pre-tokenizers (GPT-2's, Llama 3's, Qwen's, DeepSeek's) start a word's pre-token at the
# space before it, so the pieces encode to the whole text's tokens
_CUT = re.compile(r"(?<=\S) (?=\S)")


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut before a space between
    two words (a text without one for `size` characters is cut there, mid-word)."""
    out, start = [], 0
    while len(text) - start > size:
        cut = _CUT.search(text, start + size)
        end = cut.start() if cut is not None and cut.start() < start + 2 * size else start + size
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


class TokenizerError(ValueError):
    pass


# the hub organizations of the model folders the bundled configs name under assets/hf/
_HUB_ORGS = {
    "Llama": "meta-llama",
    "Qwen": "Qwen",
    "DeepSeek": "deepseek-ai",
    "Moonlight": "moonshotai",
}


def _fetch_hint(path: Path) -> str:
    """How to get the tokenizer `path` names: a model folder under assets/hf/ is fetched
    from the hub; anything else is the user's file to point at."""
    if (
        len(path.parts) >= 3
        and path.parts[-3:-1] == ("assets", "hf")
        or (len(path.parts) >= 2 and path.parts[-2] == "hf")
    ):
        model = path.name
        org = next((o for prefix, o in _HUB_ORGS.items() if model.startswith(prefix)), "ORG")
        return (
            f"fetch the model's tokenizer with `python scripts/download_hf_assets.py --repo "
            f"{org}/{model}` (gated models need `huggingface-cli login` first)"
        )
    return (
        "set model.tokenizer_path to a tokenizer.json, or a folder holding one (titan "
        "bundles assets/tokenizer/tokenizer.json for the debug models)"
    )


class Tokenizer:
    """Encodes without the file's own post-processor so BOS/EOS are added exactly once."""

    def __init__(self, path: str):
        file = resolve(path)
        if file.is_dir():
            held = sorted(p.name for p in file.iterdir())
            file = file / "tokenizer.json"
            if not file.is_file():
                raise TokenizerError(
                    f"the folder '{path}' holds no tokenizer.json"
                    + (
                        f" (it holds {', '.join(held[:5])}{' ...' if len(held) > 5 else ''})"
                        if held
                        else " (it is empty)"
                    )
                    + f"; {_fetch_hint(Path(path))}"
                )
        if not file.is_file():
            raise TokenizerError(f"tokenizer '{path}' does not exist; {_fetch_hint(Path(path))}")
        self.path = file
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception
            raise TokenizerError(f"cannot read the tokenizer {file}: {e}") from None
        self._tok.post_processor = None
        self.bos_id = self._special_id(file.parent, "bos_token", _BOS_NAMES)
        self.eos_id = self._special_id(file.parent, "eos_token", _EOS_NAMES)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _special_id(self, folder: Path, key: str, fallbacks: tuple[str, ...]) -> int:
        names = list(fallbacks)
        cfg = folder / "tokenizer_config.json"
        if cfg.is_file():  # HF model folders name their BOS/EOS here
            tok = json.loads(cfg.read_text()).get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok:
                names.insert(0, tok)
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        raise TokenizerError(f"{self.path} defines none of {names} for its {key}")

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (a special token's), None where it has none."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, bos: bool = True, eos: bool = True):
        """BOS + the text's ids + EOS: a list, or for a text longer than PIECE_CHARS an int32
        array encoded piece by piece."""
        return self.encode_batch([text], bos, eos)[0]

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list:
        head, tail = ([self.bos_id] if bos else []), ([self.eos_id] if eos else [])
        short = [t for t in texts if len(t) <= PIECE_CHARS]
        encs = iter(self._tok.encode_batch(short, add_special_tokens=False) if short else [])
        return [
            head + next(encs).ids + tail
            if len(t) <= PIECE_CHARS
            else self._encode_long(t, head, tail)
            for t in texts
        ]

    def _encode_long(self, text: str, head: list[int], tail: list[int]) -> np.ndarray:
        parts = [np.asarray(head, dtype=np.int32)]
        for piece in pieces(text, PIECE_CHARS):
            parts.append(
                np.asarray(self._tok.encode(piece, add_special_tokens=False).ids, dtype=np.int32)
            )
        parts.append(np.asarray(tail, dtype=np.int32))
        return np.concatenate(parts)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The text's ids, no BOS/EOS added (special tokens written in it are matched), and
        the (start, end) characters of the text each token covers."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    @property
    def pad_id(self) -> int:
        """The padding token: the folder's pad_token, <|pad|>, else EOS."""
        try:
            return self._special_id(self.path.parent, "pad_token", ("<|pad|>",))
        except TokenizerError:
            return self.eos_id

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def save_hf(self, out_dir: str | Path) -> dict:
        """Write the tokenizer as HF tooling loads it: tokenizer.json with a post-processor
        that adds BOS as titan does, tokenizer_config.json and special_tokens_map.json
        naming BOS/EOS. Returns the config.json entries for the token ids."""
        out_dir = Path(out_dir)
        bos, eos = self._tok.id_to_token(self.bos_id), self._tok.id_to_token(self.eos_id)
        tok = HFTokenizer.from_file(str(self.path))
        # titan prepends BOS to every document; AutoTokenizer(...)(text) then encodes alike
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)]
        )
        tok.save(str(out_dir / "tokenizer.json"))
        special = {"bos_token": bos, "eos_token": eos}
        (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        config = {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        source = self.path.parent
        if (source / "chat_template.jinja").is_file():  # chat models keep their template
            shutil.copyfile(source / "chat_template.jinja", out_dir / "chat_template.jinja")
        elif (source / "tokenizer_config.json").is_file():
            template = json.loads((source / "tokenizer_config.json").read_text()).get(
                "chat_template"
            )
            if template:
                config["chat_template"] = template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id}
