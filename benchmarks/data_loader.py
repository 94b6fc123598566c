"""Does data ever bound a step? Tokens/s of the loader alone vs what the trainer consumes.

The loader reads pretokenized shards of the bundled corpus (written here with
scripts/pretokenize.py) through `training.dataloader_num_workers` worker processes, batches
of the debug config's shape, nothing else running. The trainer is ./run_train.sh on the
debug model with the same data and loader settings; its tokens/s is the steady-state
`tps` of metrics.jsonl. Prints a table and the headroom (loader / trainer).

    python benchmarks/data_loader.py [--workers 2 --batches 400 --steps 30]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.components.data.dataloader import DataShard, Workers, build_text_dataloader  # noqa: E402
from titan.components.data.tokenizer import Tokenizer  # noqa: E402
from titan.runtime.paths import REPO_ROOT  # noqa: E402
from titan.tools.loss_compare import launch, read_metrics  # noqa: E402


def loader_tps(shards: Path, args) -> float:
    tok = Tokenizer(str(REPO_ROOT / "assets/tokenizer/tokenizer.json"))
    dl = build_text_dataloader(
        dataset="kjv",
        dataset_path=str(shards),
        tokenizer=tok,
        seq_len=args.seq_len,
        local_batch_size=args.batch,
        global_batch_size=args.batch,
        shard=DataShard(),
        seed=0,
        workers=Workers(args.workers, 2),
    )
    it = iter(dl)
    for _ in range(10):  # worker start-up
        next(it)
    t0 = time.perf_counter()
    for _ in range(args.batches):
        next(it)
    return args.batches * args.batch * args.seq_len / (time.perf_counter() - t0)


def trainer_tps(shards: Path, dump: Path, args) -> float:
    launch(
        1,
        [
            "--training.dataset_path",
            str(shards),
            "--training.steps",
            str(args.steps),
            "--training.seq_len",
            str(args.seq_len),
            "--training.local_batch_size",
            str(args.batch),
            "--training.dataloader_num_workers",
            str(args.workers),
            "--metrics.log_freq",
            "10",
            "--metrics.no_enable_tensorboard",
        ],
        dump,
        timeout=1800,
    )
    return statistics.fmean(r["tps"] for r in read_metrics(dump) if r["step"] > 10)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=2, help="loader worker processes")
    ap.add_argument("--batches", type=int, default=400, help="batches the loader alone reads")
    ap.add_argument("--steps", type=int, default=30, help="trainer steps (first 10 excluded)")
    ap.add_argument("--seq_len", type=int, default=256, help="the debug config's seq_len")
    ap.add_argument("--batch", type=int, default=8, help="the debug config's local batch")
    args = ap.parse_args()
    problem = (
        f"--steps {args.steps}: the first 10 steps are not timed; pass --steps 20 or more"
        if args.steps <= 10
        # the first 10 are start-up
        else "--workers must be >= 0 and --batches, --seq_len, --batch >= 1"
        if min(args.workers + 1, args.batches, args.seq_len, args.batch) < 1
        else None
    )
    if problem:
        print(f"data_loader.py: {problem}", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "kjv_shards"
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "scripts/pretokenize.py"), "kjv", str(shards)],
            check=True,
            capture_output=True,
        )
        loader = loader_tps(shards, args)
        trainer = trainer_tps(shards, Path(tmp) / "run", args)
    print(
        f"| what | tokens/s |\n|---|---:|\n| loader alone, {args.workers} workers | "
        f"{loader:,.0f} |\n| trainer, debug model, 1 rank | {trainer:,.0f} |\n"
        f"| headroom (loader / trainer) | {loader / trainer:,.0f}x |"
    )


if __name__ == "__main__":
    main()
