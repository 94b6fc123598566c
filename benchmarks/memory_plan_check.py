"""The memory planner against a real run, one rank: planned activations vs the trainer's
measured ones, and (on CUDA) the planned total vs `torch.cuda.max_memory_allocated`.

    python benchmarks/memory_plan_check.py             # GPU: Llama 3 1B, seq 8192, AC none/full
    python benchmarks/memory_plan_check.py --tiny      # CPU: the debug model (the code path),
                                                       # batch 1: 35.9 / 4.3 MiB (AC none / full)

Compile is off (the planner traces eagerly). Two steps: the first makes the optimizer states
after its peak, the second peaks with them, as every later step does. The bundled tokenizer
and corpus stand in for Llama's (a smaller vocabulary, so smaller logits: both sides see the
same model). Prints a table; the target is within 10%.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.config import parse_args  # noqa: E402
from titan.plan.run_plan import plan_run  # noqa: E402
from titan.planner.memory import human_bytes, rank_bytes  # noqa: E402
from titan.tools.loss_compare import launch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="the debug model on CPU")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ac", default="none,full", help="AC modes to check, comma-separated")
    args = ap.parse_args()
    config = "train_configs/debug_model.toml" if args.tiny else "train_configs/llama3_1b.toml"
    seq = 256 if args.tiny else args.seq_len
    base = [
        "--model.tokenizer_path",
        "assets/tokenizer/tokenizer.json",
        "--training.dataset",
        "kjv",
        "--training.seq_len",
        str(seq),
        "--training.local_batch_size",
        str(args.batch),
        "--training.steps",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--compile.no_enable",
        "--validation.no_enable",
        "--checkpoint.no_enable",
        "--metrics.no_enable_tensorboard",
        "--training.device",
        "cpu" if args.tiny else "cuda",
    ]
    rows = []
    for ac in args.ac.split(","):
        overrides = [*base, "--activation_checkpoint.mode", ac]
        job = parse_args(["--job.config_file", config, *overrides])
        planned = rank_bytes(job, plan_run(job, 1), 0)
        with tempfile.TemporaryDirectory() as dump:
            launch(1, overrides, dump, timeout=1200, config_file=config)
            measured = json.loads((Path(dump) / "memory_measured.json").read_text())["ranks"][0]
        rows.append((ac, planned, measured))
    print(f"{config} seq {seq} batch {args.batch}, 1 rank, compile off")
    print(
        f"{'AC':>10} {'activations planned':>20} {'measured':>12} {'ratio':>6} "
        f"{'total planned':>14} {'max allocated':>14} {'ratio':>6}"
    )
    for ac, p, m in rows:
        allocated = m.get("max_memory_allocated")
        print(
            f"{ac:>10} {human_bytes(p['activations_bytes']):>20} "
            f"{human_bytes(m['activations_bytes']):>12} "
            f"{p['activations_bytes'] / m['activations_bytes']:>6.3f} "
            f"{human_bytes(p['total_bytes']):>14} "
            f"{human_bytes(allocated) if allocated else 'n/a (CPU)':>14} "
            f"{format(p['total_bytes'] / allocated, '.3f') if allocated else 'n/a':>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
