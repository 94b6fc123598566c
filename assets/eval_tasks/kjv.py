"""Offline lm-evaluation-harness tasks over the bundled King James Bible's held-out books
(assets/corpus/kjv_valid.jsonl: 1 Peter to Revelation, never in the training split), built
when a task loads (`custom_dataset` in each YAML), the same every time."""

import json
import random
from pathlib import Path

from datasets import Dataset, DatasetDict

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "kjv_valid.jsonl"
SEED = 1234


def chapters() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def book_of(chapter_id: str) -> str:
    return chapter_id.rsplit(" ", 1)[0]


def verses() -> list[tuple[str, str]]:
    """(book, verse text) of every verse: a chapter's lines after its title."""
    out = []
    for ch in chapters():
        for line in ch["text"].split("\n")[2:]:
            if line.strip():
                out.append((book_of(ch["id"]), line.strip()))
    return out


def _halves(text: str) -> tuple[str, str] | None:
    words = text.split()
    if len(words) < 8:
        return None
    cut = len(words) // 2
    return " ".join(words[:cut]), " " + " ".join(words[cut:])


def _test(rows: list[dict]) -> DatasetDict:
    return DatasetDict({"test": Dataset.from_list(rows)})


def verse_cloze(**kwargs) -> DatasetDict:
    """A verse's first half; the choices: its own second half and three other verses'."""
    split = [h for _, text in verses() if (h := _halves(text))]
    rng = random.Random(SEED)
    rows = []
    for i, (head, tail) in enumerate(split):
        others = rng.sample([j for j in range(len(split)) if j != i], 3)
        choices = [tail] + [split[j][1] for j in others]
        order = list(range(4))
        rng.shuffle(order)
        rows.append(
            {"context": head, "choices": [choices[k] for k in order], "label": order.index(0)}
        )
    return _test(rows)


def verse_book(**kwargs) -> DatasetDict:
    """Which of the held-out books a verse is from."""
    books = sorted({b for b, _ in verses()})
    rows = [
        {"verse": text, "choices": [f" {b}" for b in books], "label": books.index(book)}
        for book, text in verses()
    ]
    return _test(rows)


def chapter_text(**kwargs) -> DatasetDict:
    """Each held-out chapter, for bits per byte."""
    return _test([{"text": ch["text"]} for ch in chapters()])


def verse_completion(**kwargs) -> DatasetDict:
    """A verse's first half, to be completed greedily up to the end of the line."""
    rows = [
        {"context": head, "target": tail}
        for _, text in verses()
        if (h := _halves(text))
        for head, tail in [h]
    ]
    return _test(rows)
