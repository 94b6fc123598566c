#!/usr/bin/env python3
"""Build the default training corpus (King James Bible) as JSON Lines.

Source: Debian package ``bible-kjv-text`` (public-domain KJV text). It ships
the text only as ``usr/lib/bible.data``, a file in the "Bible Retrieval
System" format: the plain text cut into 64 KiB windows, each compressed
independently with Unix ``compress`` (LZW) so the ``bible`` program can seek.
We decode it here in pure Python so neither the package nor its reader
program has to be installed.

Get the source (no installation needed)::

    apt-get download bible-kjv-text
    dpkg -x bible-kjv-text_*_all.deb kjv/
    python scripts/prepare_corpus.py --source kjv/

Output (deterministic for a given package version):

* ``kjv_train.jsonl`` / ``kjv_valid.jsonl``: one JSON object per chapter,
  ``{"id": "Genesis 1", "text": "Genesis 1\\n\\nIn the beginning ..."}``. The
  text is the heading line, a blank line, then one verse per line (verse
  numbers dropped so the model sees running prose). The validation split is
  the shortest tail of whole books holding at least ``--valid-fraction`` of
  all chapters, so no book is shared between the splits.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

# Canonical KJV order; the data file uses its own abbreviations (Ge, Exo, ...),
# so order, not spelling, is what ties these names to the text.
BOOKS = [
    "Genesis",
    "Exodus",
    "Leviticus",
    "Numbers",
    "Deuteronomy",
    "Joshua",
    "Judges",
    "Ruth",
    "1 Samuel",
    "2 Samuel",
    "1 Kings",
    "2 Kings",
    "1 Chronicles",
    "2 Chronicles",
    "Ezra",
    "Nehemiah",
    "Esther",
    "Job",
    "Psalms",
    "Proverbs",
    "Ecclesiastes",
    "Song of Solomon",
    "Isaiah",
    "Jeremiah",
    "Lamentations",
    "Ezekiel",
    "Daniel",
    "Hosea",
    "Joel",
    "Amos",
    "Obadiah",
    "Jonah",
    "Micah",
    "Nahum",
    "Habakkuk",
    "Zephaniah",
    "Haggai",
    "Zechariah",
    "Malachi",
    "Matthew",
    "Mark",
    "Luke",
    "John",
    "Acts",
    "Romans",
    "1 Corinthians",
    "2 Corinthians",
    "Galatians",
    "Ephesians",
    "Philippians",
    "Colossians",
    "1 Thessalonians",
    "2 Thessalonians",
    "1 Timothy",
    "2 Timothy",
    "Titus",
    "Philemon",
    "Hebrews",
    "James",
    "1 Peter",
    "2 Peter",
    "1 John",
    "2 John",
    "3 John",
    "Jude",
    "Revelation",
]
EXPECTED_VERSES = 31102  # KJV verse count; guards against a bad decode

VERSE_RE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def lzw_decompress(data: bytes, max_bits: int = 16) -> bytes:
    """Decode the code stream of a Unix ``compress`` (.Z, block mode) file."""
    table = [bytes([i]) for i in range(256)] + [b""]  # code 256 = CLEAR
    out = bytearray()
    n_bits, pos, group_start, prev = 9, 0, 0, None
    total_bits = len(data) * 8

    def realign() -> int:
        # compress(1) writes codes in groups of 8 and pads the group when the
        # code width changes; readers must skip to the end of that group.
        group = n_bits * 8
        return group_start + -(-(pos - group_start) // group) * group

    while pos + n_bits <= total_bits:
        chunk = int.from_bytes(data[pos >> 3 : (pos >> 3) + 4], "little")
        code = (chunk >> (pos & 7)) & ((1 << n_bits) - 1)
        pos += n_bits
        if code == 256:
            pos = group_start = realign()
            del table[257:]
            n_bits, prev = 9, None
            continue
        if code < len(table):
            entry = table[code]
        elif code == len(table) and prev is not None:
            entry = prev + prev[:1]  # the KwKwK case
        else:
            raise ValueError(f"corrupt LZW stream: code {code} at bit {pos}")
        if prev is not None:
            table.append(prev + entry[:1])
        out += entry
        prev = entry
        if len(table) >= (1 << n_bits) and n_bits < max_bits:
            pos = group_start = realign()
            n_bits += 1
    return bytes(out)


def read_brs_text(path: Path) -> str:
    """Return the plain text stored in a BRS ``bible.data`` file."""
    raw = path.read_bytes()
    if not raw.startswith(b"EC02Compressed Data File"):
        raise ValueError(f"{path}: not a BRS compressed data file")
    # Layout observed in bible-kjv-text 4.38: big-endian window size at 0x54,
    # window count at 0x58, then count+1 byte offsets (the last = file size).
    window, count = struct.unpack_from(">II", raw, 0x54)
    offsets = struct.unpack_from(f">{count + 1}I", raw, 0x5C)
    if offsets[-1] != len(raw):
        raise ValueError(f"{path}: window table does not match file size")
    parts = [lzw_decompress(raw[a:b]) for a, b in zip(offsets, offsets[1:])]
    if any(len(p) != window for p in parts[:-1]):
        raise ValueError(f"{path}: a window did not decode to {window} bytes")
    return b"".join(parts).decode("ascii")


def parse_chapters(text: str) -> list[tuple[str, int, list[str]]]:
    """Group ``Ge1:1 In the beginning...`` lines into (book, chapter, verses)."""
    chapters: list[tuple[str, int, list[str]]] = []
    abbrevs: list[str] = []
    n_verses = 0
    # The first line is a title banner, not a verse.
    for line in text.splitlines()[1:]:
        if not line.strip():
            continue
        m = VERSE_RE.match(line)
        if m is None:
            raise ValueError(f"unexpected line: {line!r}")
        abbrev, chap, _verse = m[1], int(m[2]), m[3]
        if not abbrevs or abbrevs[-1] != abbrev:
            abbrevs.append(abbrev)
        book = BOOKS[len(abbrevs) - 1]
        if not chapters or chapters[-1][:2] != (book, chap):
            chapters.append((book, chap, []))
        # The source has a few stray double/trailing spaces; they carry no
        # meaning and would only add rare tokens.
        chapters[-1][2].append(" ".join(m[4].split()))
        n_verses += 1
    if len(abbrevs) != len(BOOKS) or n_verses != EXPECTED_VERSES:
        raise ValueError(f"got {len(abbrevs)} books / {n_verses} verses")
    return chapters


def split_point(chapters, valid_fraction: float) -> int:
    """Index of the first chapter of the held-out tail of whole books."""
    need = valid_fraction * len(chapters)
    i = len(chapters)
    while len(chapters) - i < need:
        book = chapters[i - 1][0]
        while i > 0 and chapters[i - 1][0] == book:
            i -= 1
    return i


def write_jsonl(path: Path, chapters) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for book, chap, verses in chapters:
            heading = f"{book} {chap}"
            doc = {"id": heading, "text": heading + "\n\n" + "\n".join(verses)}
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--source",
        type=Path,
        required=True,
        help="directory unpacked with `dpkg -x bible-kjv-text_*.deb` or the bible.data file itself",
    )
    ap.add_argument("--out-dir", type=Path, default=Path("assets/corpus"))
    ap.add_argument(
        "--valid-fraction",
        type=float,
        default=0.03,
        help="minimum share of chapters held out (whole books)",
    )
    args = ap.parse_args()

    src = args.source
    if src.is_dir():
        src = src / "usr" / "lib" / "bible.data"
    chapters = parse_chapters(read_brs_text(src))
    cut = split_point(chapters, args.valid_fraction)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("kjv_train", chapters[:cut]), ("kjv_valid", chapters[cut:])):
        path = args.out_dir / f"{name}.jsonl"
        write_jsonl(path, part)
        print(
            f"{path}: {len(part)} chapters ({part[0][0]} {part[0][1]} .. "
            f"{part[-1][0]} {part[-1][1]}), {path.stat().st_size} bytes"
        )


if __name__ == "__main__":
    main()
