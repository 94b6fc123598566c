#!/usr/bin/env python3
"""Write the bundled chat corpus: synthetic conversations about the bundled King James text
(public domain), for supervised fine-tuning tests and the SFT quick start.

    python scripts/make_chat_corpus.py     # assets/corpus/chat_train.jsonl, chat_valid.jsonl

Each record is {"messages": [{"role", "content"}, ...]}: one to three user/assistant turns,
some opened by a system prompt. The questions ask for a verse by its place, the verse after a
given one, a chapter's opening, or how many verses a chapter has; the answers are read from
the corpus, so they are true. Deterministic: the same files on every run. The train split
draws on the train corpus's chapters, the valid split on the valid corpus's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = [
    "You answer questions about the King James Bible, quoting it exactly.",
    "You are a concise assistant. Quote scripture word for word.",
    "Answer briefly.",
]


def chapters(path: Path) -> list[tuple[str, list[str]]]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        verses = record["text"].split("\n\n", 1)[1].split("\n")
        out.append((record["id"], verses))
    return out


def turn(rng: random.Random, chapter: str, verses: list[str]) -> tuple[str, str]:
    """One (question, answer) about a chapter."""
    kind = rng.randrange(4)
    v = rng.randrange(len(verses))
    if kind == 0:
        return f"What does {chapter}:{v + 1} say?", verses[v]
    if kind == 1 and v + 1 < len(verses):
        return (
            f"Which verse follows this one in {chapter}?\n\n{verses[v]}",
            f"{chapter}:{v + 2} reads: {verses[v + 1]}",
        )
    if kind == 2:
        return f"How does {chapter} begin?", " ".join(verses[:2])
    return (
        f"How many verses are in {chapter}?",
        f"{chapter} has {len(verses)} verses.",
    )


def conversations(source: list[tuple[str, list[str]]], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chapter, verses = source[rng.randrange(len(source))]
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(rng.choice((1, 1, 2, 3))):
            question, answer = turn(rng, chapter, verses)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        out.append({"messages": messages})
    return out


def main() -> None:
    corpus = ROOT / "assets/corpus"
    for name, source, n, seed in (
        ("chat_train.jsonl", "kjv_train.jsonl", 600, 0),
        ("chat_valid.jsonl", "kjv_valid.jsonl", 60, 1),
    ):
        records = conversations(chapters(corpus / source), n, seed)
        (corpus / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {corpus / name}: {len(records)} conversations")


if __name__ == "__main__":
    main()
