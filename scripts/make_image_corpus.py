#!/usr/bin/env python3
"""Write the bundled image-caption corpus: small pictures of coloured shapes, each with the
caption that says what it shows, for the vision-language tests and quick start (issue 73).

    python scripts/make_image_corpus.py   # assets/images/shapes/{train,valid}.jsonl + PNGs

Each picture is 64 x 64 pixels (or 64 x 96, 96 x 64: a tower's grid is not always square) on
a plain background, holding one or two shapes (circle, square, triangle) in one of six
colours, left or right, above or below; the caption names them and where they stand ("a red
circle on the left and a blue square on the right."). What the caption says can be read only
from the picture, so a model learns it only through its vision tower. Each record is
{"image": "<file relative to the jsonl>", "text": "<caption>"}; `chat_{train,valid}.jsonl` hold
the same pictures as image-chat records (a question, the caption as the answer).
Deterministic: the same pixels and captions on every run (tests/unit/test_image_corpus.py
draws them again).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "assets" / "images" / "shapes"
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 40),
    "purple": (140, 60, 180),
    "orange": (240, 130, 30),
}
SHAPES = ("circle", "square", "triangle")
SIZES = ((64, 64), (96, 64), (64, 96))  # (width, height)
SPLITS = {"train": (400, 0), "valid": (40, 1)}  # pictures, seed


def draw_shape(draw, shape: str, box: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def picture(rng: random.Random):
    """(a PIL image, its caption)."""
    from PIL import Image, ImageDraw

    width, height = rng.choice(SIZES)
    background = tuple(rng.randrange(225, 256) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    n = rng.choice((1, 2))
    across = width >= height if n == 2 else rng.random() < 0.5
    places = (("on the left", "on the right") if across else ("at the top", "at the bottom"))[:n]
    parts = []
    for i, place in enumerate(places):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        side = min(width, height) // 2 - (4 if n == 1 else 8)  # two shapes never touch
        if n == 1:
            x0, y0 = (width - side) // 2, (height - side) // 2
        elif across:
            x0, y0 = (width // 2) * i + (width // 2 - side) // 2, (height - side) // 2
        else:
            x0, y0 = (width - side) // 2, (height // 2) * i + (height // 2 - side) // 2
        x0, y0 = x0 + rng.randrange(-2, 3), y0 + rng.randrange(-2, 3)
        draw_shape(draw, shape, (x0, y0, x0 + side, y0 + side), COLOURS[colour])
        article = "an" if colour[0] in "aeiou" else "a"
        parts.append(f"{article} {colour} {shape}" + (f" {place}" if n == 2 else ""))
    return image, " and ".join(parts) + "."


def records(split: str) -> list[tuple[object, str]]:
    count, seed = SPLITS[split]
    rng = random.Random(f"shapes-{seed}")
    return [picture(rng) for _ in range(count)]


# the questions of the image-chat records, taken in turn
QUESTIONS = ("What is in the picture?", "Describe the picture.", "What do you see?")


def conversation(name: str, caption: str, i: int) -> dict:
    """An image-chat record of a picture: a question about it, its caption as the answer."""
    question = {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}
    return {
        "image": name,
        "messages": [
            {"role": "user", "content": [{"type": "image"}, question]},
            {"role": "assistant", "content": caption[0].upper() + caption[1:]},
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT), help="folder of the jsonl files and pictures")
    out = Path(ap.parse_args().out)
    for split in SPLITS:
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        lines, chat = [], []
        for i, (image, caption) in enumerate(records(split)):
            name = f"{split}/{i:04d}.png"
            image.save(out / name, optimize=True)
            lines.append(json.dumps({"image": name, "text": caption}))
            chat.append(json.dumps(conversation(name, caption, i)))
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        (out / f"chat_{split}.jsonl").write_text("\n".join(chat) + "\n")
        print(f"{out / split}.jsonl, chat_{split}.jsonl: {len(lines)} pictures")


if __name__ == "__main__":
    main()
