"""Memory and time of tokenizing one very long document into the token cache: a JSON-lines file
holding a single line of MB of text (a dumped book, a log), as a local dataset is first read.

    python benchmarks/long_document.py [--mb 50]

Runs the cache's tokenization (titan.components.data.packed.cached_tokens) in a fresh process
and prints its peak RSS above the process's RSS before it started (torch and titan imported),
the time, and the tokens written. The tokenizer is handed pieces of at most ~PIECE_CHARS
characters (titan.components.data.tokenizer): its working memory grows with the text it is
given, ~180 bytes a character at once for the whole 50 MB line.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import resource, sys, time
from pathlib import Path
from titan.components.data.packed import cached_tokens
from titan.components.data.tokenizer import Tokenizer
tok = Tokenizer("assets/tokenizer/tokenizer.json")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
tokens = cached_tokens([Path(sys.argv[1])], tok, "text")
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t0,
      len(tokens))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0, help="the document's size in MB")
    args = ap.parse_args()
    if args.mb <= 0:
        print("long_document.py: --mb must be > 0", file=sys.stderr)
        sys.exit(2)
    corpus = [
        json.loads(x)["text"]
        for x in (REPO / "assets/corpus/kjv_train.jsonl").read_text().splitlines()
    ]
    words = " ".join(corpus).split()
    with tempfile.TemporaryDirectory() as tmp:
        text, n = [], 0
        while n < args.mb * 1e6:
            for w in words:
                text.append(w)
                n += len(w) + 1
                if n >= args.mb * 1e6:
                    break
        path = Path(tmp) / "one_line.jsonl"
        path.write_text(json.dumps({"text": " ".join(text)}) + "\n")
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(path)],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            env={
                "TITAN_CACHE_DIR": str(Path(tmp) / "cache"),
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": str(REPO),
            },
        ).stdout
    before, peak, seconds, tokens = out.split()
    print(
        f"| document | peak RSS above start | time | tokens |\n|---|---:|---:|---:|\n"
        f"| {args.mb:g} MB, one line | {(int(peak) - int(before)) / 2**20:.2f} GiB | "
        f"{float(seconds):.1f} s | {int(tokens):,} |"
    )


if __name__ == "__main__":
    main()
