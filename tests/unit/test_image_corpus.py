"""The bundled pictures are what scripts/make_image_corpus.py draws: the same captions and
pixels, each caption naming what its picture shows; small enough to ship."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import make_image_corpus as corpus  # noqa: E402


def pixels(image) -> torch.Tensor:
    return torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8)


@pytest.mark.needs("PIL")
@pytest.mark.parametrize("split", list(corpus.SPLITS))
def test_the_bundled_pictures_are_the_scripts(split):
    from PIL import Image

    lines = (corpus.OUT / f"{split}.jsonl").read_text().splitlines()
    drawn = corpus.records(split)
    assert len(lines) == len(drawn) == corpus.SPLITS[split][0]
    chat = (corpus.OUT / f"chat_{split}.jsonl").read_text().splitlines()
    for i, (line, (image, caption)) in enumerate(zip(lines, drawn, strict=True)):
        record = json.loads(line)
        assert record["text"] == caption
        assert json.loads(chat[i]) == corpus.conversation(record["image"], caption, i)
        with Image.open(corpus.OUT / record["image"]) as bundled:
            assert bundled.size == image.size and torch.equal(pixels(bundled), pixels(image))


@pytest.mark.needs("PIL")
def test_a_caption_names_the_colours_it_shows():
    # each named colour covers some pixels of its picture; an unnamed one none
    for image, caption in corpus.records("valid")[:20]:
        x = pixels(image).view(-1, 3)
        for name, rgb in corpus.COLOURS.items():
            present = bool((x == torch.tensor(rgb, dtype=torch.uint8)).all(-1).any())
            assert present == (f" {name} " in f" {caption} "), (name, caption)


def test_the_set_is_small():
    size = sum(p.stat().st_size for p in corpus.OUT.rglob("*") if p.is_file())
    assert size < 1_000_000, size
