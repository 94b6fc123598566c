#!/usr/bin/env python3
"""Write an HF tokenizer folder for chat: a base tokenizer.json with a chat format's special
tokens added, its chat template (chat_template.jinja) and tokenizer_config.json naming BOS, EOS
and padding, so titan and transformers' AutoTokenizer read the same folder.

    python scripts/chat_tokenizer.py                       # assets/tokenizer_chat (Llama 3 format)
    python scripts/chat_tokenizer.py --format qwen3 --out /tmp/qwen3_chat
    python scripts/chat_tokenizer.py --format qwen3_vl --out assets/tokenizer_vlm

The added tokens take the ids after the base vocabulary (the bundled one's 2048).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

ROOT = Path(__file__).resolve().parent.parent

# per format: (its special tokens, BOS, EOS: what ends an assistant turn when generating)
FORMATS = {
    "llama3": (
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen3": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>"),
    # a vision-language model's: ChatML and the vision tokens (assets/tokenizer_vlm)
    "qwen3_vl": (
        ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"],
        "<|begin_of_text|>",
        "<|im_end|>",
    ),
    "deepseek_v3": (
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    ),
}


def write_chat_tokenizer(
    out: Path, fmt: str, base: Path = ROOT / "assets/tokenizer/tokenizer.json"
) -> Path:
    """`out` holding tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    specials, bos, eos = FORMATS[fmt]
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(base))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    shutil.copyfile(ROOT / f"assets/chat_templates/{fmt}.jinja", out / "chat_template.jinja")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=sorted(FORMATS), default="llama3")
    p.add_argument("--out", type=Path, default=ROOT / "assets/tokenizer_chat")
    args = p.parse_args()
    folder = write_chat_tokenizer(args.out, args.format)
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    print(f"wrote {folder} ({size} tokens)")


if __name__ == "__main__":
    main()
