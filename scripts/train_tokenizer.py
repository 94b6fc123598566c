#!/usr/bin/env python3
"""Train the default byte-level BPE tokenizer on JSON Lines text.

    python scripts/train_tokenizer.py --data assets/corpus/kjv_train.jsonl

Special tokens get the lowest ids: ``<|begin_of_text|>`` = 0,
``<|end_of_text|>`` = 1, ``<|pad|>`` = 2. No post-processor is attached, so
``encode`` never inserts BOS/EOS; the training code adds them itself.
Byte-level means every string round-trips through encode/decode and there is
no unknown token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def iter_texts(paths: list[Path]):
    for path in paths:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]


def build_tokenizer(paths: list[Path], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # No prefix space: the text is fed as-is, so decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols up front, so bytes unseen in training (other
        # scripts, emoji) still encode instead of being dropped.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(paths), trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data",
        type=Path,
        nargs="+",
        default=[Path("assets/corpus/kjv_train.jsonl")],
        help="JSON Lines file(s) with a 'text' field",
    )
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("assets/tokenizer/tokenizer.json"))
    args = ap.parse_args()

    tok = build_tokenizer(args.data, args.vocab_size)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, f"{name} did not get id {i}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))  # pretty JSON: readable diffs when retrained
    print(f"{args.out}: vocab size {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
