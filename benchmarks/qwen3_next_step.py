"""Qwen3-Next's debug model against Llama 3's at the same width (dim 256), one CPU process:
step time and per-layer step time, runs interleaved (llama3, qwen3_next, llama3, ...) so
machine load falls on each alike. Llama 3's debug model has 6 layers (SwiGLU 768, 16 heads of
16); Qwen3-Next's 4 (3 Gated DeltaNet: 4 key heads of 32 serving 8 value heads of 32; 1 gated
attention: 8 heads of 64; an MoE of 8 experts of 128, 2 a token, beside a shared expert of
128, in 3 of them).

    python benchmarks/qwen3_next_step.py [--rounds 3 --steps 30 --seq-len 256]

Each run is `python -m titan.trainer` on one process, float32; its step time is the median
over the steps after the first 5 of tokens / tokens-per-second from metrics.jsonl.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from stability_overhead import step_seconds  # benchmarks/ is on the script's path

MODELS = {
    "llama3 debugmodel (6 layers)": ("debug_model.toml", 6),
    "qwen3_next debugmodel (4 layers)": ("qwen3_next_debug.toml", 4),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    times = {name: [] for name in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, (config, _)) in enumerate(MODELS.items()):
                folder = Path(tmp) / f"{r}-{i}"
                times[name].append(step_seconds([], args, folder, config))
    base = statistics.median(next(iter(times.values())))
    print(f"seq {args.seq_len} x batch {args.batch}, float32, 1 process, {args.rounds} rounds")
    print("| model | step s | per layer s | vs llama3 (step) |")
    print("|---|---|---|---|")
    for name, (_, layers) in MODELS.items():
        t = statistics.median(times[name])
        print(f"| {name} | {t:.4f} | {t / layers:.4f} | {t / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
