"""The debug vision-language model's step against text-only training at the same width, one
rank: step time, tokens/s, and the activations the memory planner counts against those the
run measured after its first step.

    python benchmarks/vlm_step.py               # CPU: train_configs/debug_vlm.toml, 20 steps
    python benchmarks/vlm_step.py --steps 40

Rows: Qwen3-VL's debug model on the bundled pictures with their captions (the tower runs on
each window's images: 16 to 24 of its places an image's, 3 to 6 images a window); the same
model on text (kjv: the tower idle); Qwen3's debug model (the same decoder, no tower) on text.
The planner counts the heaviest image batch it can be handed (every window one image filling
it), so its figure for the image row is a bound over the bundled data's, not a prediction of
it. Prints a table.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.config import parse_args  # noqa: E402
from titan.plan.run_plan import plan_run  # noqa: E402
from titan.planner.memory import human_bytes, rank_bytes  # noqa: E402
from titan.tools.loss_compare import launch, read_metrics  # noqa: E402

CONFIG = "train_configs/debug_vlm.toml"
TEXT = ["--training.dataset", "kjv", "--training.dataset_format", "text"]
ROWS = {
    "qwen3_vl on pictures + captions": [],
    "qwen3_vl on text (tower idle)": TEXT,
    "qwen3 (no tower) on text": [*TEXT, "--model.name", "qwen3"],
}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    base = [
        "--training.steps",
        str(args.steps),
        "--checkpoint.no_enable",
        "--metrics.no_enable_tensorboard",
        "--training.device",
        "cpu",
    ]
    print(f"{CONFIG}, 1 rank, {args.steps} steps (step time: median after the 5th)")
    print(
        f"{'run':>34} {'step s':>8} {'tokens/s':>9} {'loss first/last':>16} "
        f"{'act. planned':>13} {'measured':>10} {'ratio':>6}"
    )
    for name, extra in ROWS.items():
        overrides = [*base, *extra]
        job = parse_args(["--job.config_file", CONFIG, *overrides])
        planned = rank_bytes(job, plan_run(job, 1), 0)["activations_bytes"]
        with tempfile.TemporaryDirectory() as dump:
            launch(1, overrides, dump, timeout=1800, config_file=CONFIG)
            records = read_metrics(dump)
            measured = json.loads((Path(dump) / "memory_measured.json").read_text())
        acts = measured["ranks"][0]["activations_bytes"]
        steady = [r["step_time_s"] for r in records[5:]] or [records[-1]["step_time_s"]]
        tps = statistics.median(r["tps"] for r in records[5:] or records)
        print(
            f"{name:>34} {statistics.median(steady):>8.3f} {tps:>9,.0f} "
            f"{records[0]['loss']:>7.3f}/{records[-1]['loss']:<8.3f} "
            f"{human_bytes(planned):>13} {human_bytes(acts):>10} {planned / acts:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
