"""torch.compile against eager on CPU (inductor's C++ backend): the dense and the MoE debug
models on 1 rank and under FSDP 2, through run_train.sh, eager and compiled runs interleaved
(round after round) so that machine load falls on both alike.

Prints per model and layout: tokens/s of the job (rank 0's `tps` x ranks, median over the steps
after warm-up, then over rounds), compiled / eager, and the graph breaks torch logged on rank 0
(TORCH_LOGS=graph_breaks).

    python benchmarks/compile_cpu.py [--rounds 2 --steps 16]
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titan.tools.loss_compare import launch, read_metrics  # noqa: E402

MODELS = {"dense": "train_configs/debug_model.toml", "moe": "train_configs/qwen3_moe_debug.toml"}
LAYOUTS = {"1 rank": (1, []), "FSDP 2": (2, ["--parallelism.data_parallel_shard_degree", "2"])}
WARMUP = 5  # steps left out of the median: compilation, allocator and cache warm-up


def run(config: str, ranks: int, layout: list[str], compiled: bool, steps: int, dump: Path):
    overrides = [
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        str(8 // ranks),
        "--training.global_batch_size",
        "8",
        "--metrics.log_freq",
        "1",
        "--metrics.no_enable_tensorboard",
        "--validation.no_enable",
        *layout,
        *(["--compile.enable"] if compiled else []),
    ]
    proc = launch(
        ranks, overrides, dump, config_file=config, timeout=900, env={"TORCH_LOGS": "graph_breaks"}
    )
    records = read_metrics(dump)
    tps = [r["tps"] * ranks for r in records if r["step"] > WARMUP]
    breaks = (proc.stdout + proc.stderr).count("Graph break")
    return statistics.median(tps), breaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="titan-compile-") as tmp:
        for r in range(args.rounds):
            for model, config in MODELS.items():
                for layout, (ranks, extra) in LAYOUTS.items():
                    for compiled in (False, True):
                        dump = Path(tmp) / f"{model}-{ranks}-{compiled}-{r}"
                        got = run(config, ranks, extra, compiled, args.steps, dump)
                        results.setdefault((model, layout, compiled), []).append(got)
                        print(
                            f"round {r} {model} {layout} {'compile' if compiled else 'eager'}: "
                            f"{got[0]:,.0f} tokens/s, {got[1]} graph breaks",
                            flush=True,
                        )
    print(
        "\n| model | layout | eager tokens/s | compiled tokens/s | compiled / eager | "
        "graph breaks |"
    )
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        for layout in LAYOUTS:
            eager = statistics.median(x[0] for x in results[(model, layout, False)])
            comp = statistics.median(x[0] for x in results[(model, layout, True)])
            breaks = max(x[1] for x in results[(model, layout, True)])
            print(
                f"| {model} | {layout} | {eager:,.0f} | {comp:,.0f} | {comp / eager:.3f} | "
                f"{breaks} |"
            )


if __name__ == "__main__":
    main()
