"""HF `tokenizers` tokenizer.json loader with explicit BOS/EOS handling."""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from titan.paths import resolve

# names used by Llama 3, GPT-2 style and SentencePiece-converted tokenizers, in that order
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>")


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """Encodes without the file's own post-processor so BOS/EOS are added exactly once."""

    def __init__(self, path: str):
        file = resolve(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(
                f"tokenizer file '{path}' not found; set model.tokenizer_path to a tokenizer.json "
                "(or a folder holding one), e.g. assets/tokenizer/tokenizer.json"
            )
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

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        head, tail = ([self.bos_id] if bos else []), ([self.eos_id] if eos else [])
        return [head + e.ids + tail for e in encs]

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
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, self.bos_id)])
        tok.save(str(out_dir / "tokenizer.json"))
        special = {"bos_token": bos, "eos_token": eos}
        (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        config = {**special, "tokenizer_class": "PreTrainedTokenizerFast",
                  "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id}
