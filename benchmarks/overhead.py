"""Trainer overhead: tokens/s of ./run_train.sh vs a bare hand-written loop (bare_loop.py).

Both train the same model on the same data with the same optimizer, in separate fresh
processes, interleaved A B A B ... so machine drift hits both alike. Steady state only:
the first `--warmup` steps of each run are excluded. Prints a table and the ratio
(trainer / bare; target >= 0.97).

    python benchmarks/overhead.py [--rounds 3 --steps 40]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.runtime.paths import REPO_ROOT  # noqa: E402
from titan.tools.loss_compare import launch, read_metrics  # noqa: E402


def trainer_tps(args, dump: Path) -> float:
    launch(
        1,
        [
            "--model.flavor",
            args.flavor,
            "--training.seq_len",
            str(args.seq_len),
            "--training.local_batch_size",
            str(args.batch),
            "--training.steps",
            str(args.steps),
            "--metrics.log_freq",
            str(args.warmup),
            "--training.gc_freq",
            "50",
            "--training.mixed_precision_param",
            "float32",
        ],
        dump,
        timeout=1800,
    )
    # each record's tps covers the log_freq steps before it; skip the warmup window
    windows = [
        r["tps"]
        for r in read_metrics(dump)
        if r["step"] > args.warmup and r["step"] % args.warmup == 0
    ]
    return statistics.fmean(windows)


def bare_tps(args) -> float:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bare_loop.py"),
            "--flavor",
            args.flavor,
            "--seq_len",
            str(args.seq_len),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            t = trainer_tps(args, Path(tmp) / f"round{r}")
            b = bare_tps(args)
            rows.append((r + 1, t, b, t / b))
            print(
                f"round {r + 1}: trainer {t:,.0f} tok/s, bare {b:,.0f} tok/s, ratio {t / b:.3f}",
                flush=True,
            )
    print(f"\n{'round':>5} {'trainer tok/s':>14} {'bare tok/s':>12} {'ratio':>7}")
    for r, t, b, q in rows:
        print(f"{r:>5} {t:>14,.0f} {b:>12,.0f} {q:>7.3f}")
    t_all = statistics.fmean(t for _, t, _, _ in rows)
    b_all = statistics.fmean(b for _, _, b, _ in rows)
    print(f"{'mean':>5} {t_all:>14,.0f} {b_all:>12,.0f} {t_all / b_all:>7.3f}   (target >= 0.97)")


if __name__ == "__main__":
    main()
