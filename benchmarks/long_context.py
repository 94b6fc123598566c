"""Step time and peak memory per rank against sequence length, for each kind of context
parallelism: ring attention (with and without head-tail load balancing), all-to-all (Ulysses),
the hybrid (all-to-all in pairs, --cp 4 or more), each with causal and with document
(block-causal) masks.

    python benchmarks/long_context.py                         # CP 2, seq 512 .. 8192
    python benchmarks/long_context.py --seqs 512,1024 --cp 2 --plot docs/long_context.png
    python benchmarks/long_context.py --cp 4 --types ring,alltoall,hybrid --masks causal
    python benchmarks/long_context.py --json a.jsonl ...; --plot-from a.jsonl,b.jsonl --plot x.png

Each row is a real `run_train.sh` launch of the Llama 3 debug model (width 256, 6 layers, 16
heads, 8 kv heads), fp32, batch 1, full activation checkpointing (so memory shows attention's
own working set, not every layer's), on the bundled corpus (its documents for the block-causal
rows). Step time is the mean of the steps after `--warmup`; memory is rank 0's peak (RSS on
CPU, reserved memory on CUDA). Prints a markdown table; `--plot` draws both curves per type.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.tools.loss_compare import RunFailed, launch, read_metrics  # noqa: E402

# (name, overrides): the rows of each sequence length
TYPES = {
    "ring": ["--parallelism.context_parallel_type", "ring"],
    "ring-unbalanced": [
        "--parallelism.context_parallel_type",
        "ring",
        "--parallelism.no_context_parallel_load_balance",
    ],
    "alltoall": ["--parallelism.context_parallel_type", "alltoall"],
    # all-to-all inside pairs of ranks, a ring of K/V across the pairs: needs --cp 4
    "hybrid": [
        "--parallelism.context_parallel_type",
        "hybrid",
        "--parallelism.context_parallel_alltoall_degree",
        "2",
    ],
}
MASKS = {"causal": [], "documents": ["--model.attn_mask_type", "block_causal"]}


def run_row(seq: int, cp: int, flags: list[str], steps: int, warmup: int) -> dict:
    overrides = [
        "--training.seq_len",
        str(seq),
        "--training.local_batch_size",
        "1",
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "full",
        "--parallelism.context_parallel_degree",
        str(cp),
        "--metrics.log_freq",
        "1",
        "--metrics.no_enable_tensorboard",
        "--validation.no_enable",
        "--checkpoint.no_enable",
        # a long step is what is measured here, not a hang for the watchdog to end
        "--comm.train_timeout_seconds",
        "3600",
        *flags,
    ]
    with tempfile.TemporaryDirectory() as dump:
        try:
            launch(cp, overrides, dump, timeout=1800)
        except RunFailed as e:
            return {"error": str(e).splitlines()[-1][:120]}
        records = read_metrics(dump)
    timed = [r for r in records if r["step"] > warmup]
    # tps counts this rank's share of the step's tokens: one sequence over cp ranks
    step_s = sum(seq / cp / r["tps"] for r in timed) / len(timed)
    return {"step_s": step_s, "memory_gib": max(r["memory_gib"] for r in records)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        ok = [r for r in rows if r["label"] == label and "step_s" in r]
        seqs = [r["seq"] for r in ok]
        ax_t.plot(seqs, [r["step_s"] for r in ok], marker="o", label=label)
        ax_m.plot(seqs, [r["memory_gib"] for r in ok], marker="o", label=label)
    for ax, what in ((ax_t, "step time (s)"), (ax_m, "peak memory per rank (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_m.legend(fontsize=7)
    fig.suptitle(f"context parallelism {rows[0]['cp']} on CPU, Llama 3 debug width, full AC")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192", help="sequence lengths")
    ap.add_argument("--cp", type=int, default=2, help="context-parallel degree (ranks)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument(
        "--types",
        default=None,
        help="comma-separated, of " + ", ".join(TYPES) + " (default: all; hybrid from --cp 4)",
    )
    ap.add_argument("--masks", default=",".join(MASKS), help="causal,documents")
    ap.add_argument("--plot", default=None, help="PNG file for the curves")
    ap.add_argument("--json", default=None, help="write the rows here (JSON lines, appended)")
    ap.add_argument(
        "--plot-from",
        default=None,
        help="comma-separated --json files: plot their rows into --plot and run nothing",
    )
    args = ap.parse_args()
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot")
        rows = [
            json.loads(line)
            for f in args.plot_from.split(",")
            for line in Path(f).read_text().splitlines()
            if line.strip()
        ]
        plot(rows, Path(args.plot))
        print(f"plot: {args.plot} ({len(rows)} rows)")
        return 0
    if args.types is None:
        args.types = ",".join(t for t in TYPES if t != "hybrid" or args.cp >= 4)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    seqs = [int(s) for s in args.seqs.split(",")]
    if any(s % (2 * args.cp) for s in seqs):
        ap.error(f"every sequence length must divide by 2 x cp = {2 * args.cp}")
    rows = []
    print("| CP type | mask | seq | step s | s / token x 1e3 | peak GiB (rank 0) |")
    print("|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        for mask in args.masks.split(","):
            for seq in seqs:
                row = {"label": f"{kind}, {mask}", "cp": args.cp, "seq": seq}
                row.update(
                    run_row(seq, args.cp, TYPES[kind] + MASKS[mask], args.steps, args.warmup)
                )
                rows.append(row)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
                if "error" in row:
                    print(f"| {kind} | {mask} | {seq} | failed: {row['error']} | | |", flush=True)
                else:
                    print(
                        f"| {kind} | {mask} | {seq} | {row['step_s']:.3f} | "
                        f"{1e3 * row['step_s'] / seq:.3f} | {row['memory_gib']:.2f} |",
                        flush=True,
                    )
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"\nplot: {args.plot}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
