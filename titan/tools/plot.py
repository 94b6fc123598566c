"""Plot runs: `python -m titan.tools.plot DUMP [DUMP ...] -o out.png`.

Loss (and validation loss, dashed, where validation.jsonl has it), grad norm, learning rate,
tokens/s, MFU and peak memory against step, and a panel for each downstream score in
eval.jsonl ([eval]: eval/<task>/<metric>), one line per run in the same colour on every
panel. A DUMP is a dump folder (it holds metrics.jsonl) or a folder of them, such as the
loss-compare tool's --out (baseline/, candidate0/, ...). Needs matplotlib
(pip install 'titan[plot]').
"""

import argparse
import sys
from pathlib import Path

from titan.tools.loss_compare import read_metrics

# (metrics.jsonl key, panel title)
PANELS = (
    ("loss", "loss"),
    ("grad_norm", "grad norm"),
    ("lr", "learning rate"),
    ("tps", "tokens/s (per device)"),
    ("mfu", "MFU %"),
    ("memory_gib", "peak memory GiB"),
)
MISSING = "the plot tool needs matplotlib: pip install 'titan[plot]' (or matplotlib)"


def find_runs(paths: list[str]) -> dict[str, Path]:
    """{label: dump folder} for the given folders, expanding a folder of dump folders."""
    runs = {}
    for p in map(Path, paths):
        found = (
            [p]
            if (p / "metrics.jsonl").exists()
            else sorted(d for d in p.glob("*") if (d / "metrics.jsonl").exists())
        )
        if not found:
            raise ValueError(
                f"{p}: no metrics.jsonl in it or in its subfolders; give a "
                "run's dump folder (job.dump_folder)"
            )
        for d in found:
            if not read_metrics(d):
                raise ValueError(
                    f"{d / 'metrics.jsonl'} holds no logged step yet; plot it once "
                    "the run has logged one, or leave it out"
                )
            label = d.name if d.name not in runs else str(d)
            runs[label] = d
    return runs


def plot_runs(runs: dict[str, Path], out: str | Path):
    """Draws `runs` into the PNG `out`; returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    evals = {label: read_metrics(folder, "eval.jsonl") for label, folder in runs.items()}
    scores = sorted({k for rs in evals.values() for r in rs for k in r} - {"step", "seconds"})
    panels = [*PANELS, *((key, f"eval: {key}") for key in scores)]
    rows = -(-len(panels) // 3)
    size = (15, 4 * rows)
    fig, axes = plt.subplots(rows, 3, figsize=size, constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, folder) in enumerate(runs.items()):
        records = read_metrics(folder) + evals[label]
        val = read_metrics(folder, "validation.jsonl")
        color = colors[i % len(colors)]
        for ax, (key, _) in zip(axes.flat, panels):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, label=label)
        if val:
            axes.flat[0].plot(
                [r["step"] for r in val],
                [r["val_loss"] for r in val],
                color=color,
                linestyle="--",
                marker=".",
                label=f"{label} (validation)",
            )
    for ax, (key, title) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
        else:
            ax.text(
                0.5,
                0.5,
                f"no {key} logged" + (" (CPU: no peak FLOP/s)" if key == "mfu" else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    axes.flat[3].ticklabel_format(axis="y", style="plain")
    fig.savefig(out, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m titan.tools.plot",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    ap.add_argument("dumps", nargs="+", help="dump folders, or folders of them")
    ap.add_argument("-o", "--out", default="titan_runs.png", help="the PNG to write")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"plot: {MISSING}", file=sys.stderr)
        return 2
    try:
        runs = find_runs(args.dumps)
    except ValueError as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    try:
        plot_runs(runs, args.out)
    except ValueError as e:  # a damaged metrics file
        print(f"plot: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"plot: cannot write {args.out}: {e.strerror or e}; pass -o a path in a "
            "writable folder",
            file=sys.stderr,
        )
        return 2
    print(f"plot: {len(runs)} run{'s' if len(runs) > 1 else ''} drawn to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
