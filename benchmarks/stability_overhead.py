"""What the stability settings cost a step: the debug model trained with spike detection
(stability.spike_window, on_spike = skip) and PaLM's z-loss (training.z_loss_weight) on, then
with QK-clip (optimizer.qk_clip_threshold) too, against the same run with all off, runs
interleaved (off, on, all, off, ...) so machine load falls on each alike. Goal: under 2% of the
step time (no spike reruns).

    python benchmarks/stability_overhead.py [--rounds 5 --steps 30 --seq-len 256]

Each run is `python -m titan.trainer` on one process; its step time is the median over the
steps after the first 5 of tokens / tokens-per-second from metrics.jsonl. Prints the median
over rounds per setting and the ratio.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ON = [
    *("--stability.spike_window", "20", "--stability.on_spike", "skip"),
    *("--training.z_loss_weight", "1e-4"),
]
SETTINGS = {
    "off": [],
    "spike detection (window 20, skip) + z-loss 1e-4": ON,
    # Kimi K2's threshold: the debug model's logits stay far below it, so this times the
    # per-head maximum and the per-step reduction and rescale, as a run pays them every step
    "the same + QK-clip 100": [*ON, "--optimizer.qk_clip_threshold", "100"],
}


def step_seconds(flags: list[str], args, folder: Path, config: str = "debug_model.toml") -> float:
    """The median step time of one `python -m titan.trainer` run of train_configs/`config`
    with `flags` (args: steps, seq_len, batch)."""
    dump = folder / "dump"
    cmd = [
        *(sys.executable, "-m", "titan.trainer", "--job.config_file"),
        str(REPO / "train_configs" / config),
        *("--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(args.batch), "--metrics.log_freq", "1"),
        *("--metrics.no_enable_tensorboard", "--training.mixed_precision_param", "float32"),
        *("--job.dump_folder", str(dump), *flags),
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=900)
    records = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    tokens = args.batch * args.seq_len
    return statistics.median(tokens / r["tps"] for r in records if r["step"] > 5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    times = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, flags) in enumerate(SETTINGS.items()):
                folder = Path(tmp) / f"{i}-{r}"
                times[name].append(step_seconds(flags, args, folder))
                print(f"round {r + 1} {name}: {times[name][-1] * 1e3:.1f} ms/step", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    off = median["off"]
    print("\n| setting | ms/step, each round | median | / off |\n|---|---|---|---|")
    for name, t in times.items():
        rounds = ", ".join(f"{x * 1e3:.1f}" for x in t)
        print(f"| {name} | {rounds} | {median[name] * 1e3:.1f} | {median[name] / off:.3f} |")
    print("\ngoal: < 1.02 of off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
