"""Cost curves against this machine's limits, each measured beside the limit it is held to,
in the same run: training runs (./run_train.sh) against the fp32 matrix-multiply throughput
of this CPU, checkpoint saves and loads against the disk's sequential bandwidth.

    python benchmarks/scaling.py [--parts seq,experts,ep,checkpoint] [--plots docs]

Parts (tables printed as markdown; one PNG per curve under --plots, with matplotlib):
  seq         step time and peak memory vs sequence length (tokens per step fixed), dense
              and MoE debug models, 1 rank
  experts     the MoE debug model at equal active parameters (top-k x expert width 256): more,
              narrower experts at equal total size, and more experts at width 128
  ep          the MoE debug model on 2 and 4 ranks, expert parallelism 1 to 4
  checkpoint  sync save, resume load and HF import of Llama 3 at 3 sizes (AdamW state) in
              GiB/s, against the disk's write and cold-read bandwidth in the same folder; time
              from launch to the end of the first step
Every training row carries its "CPU MFU": the trainer's achieved FLOP/s per rank over the
matmul throughput measured here at that rank's threads. Loads read cold files: each checkpoint
is evicted from the page cache first (posix_fadvise DONTNEED after its fsync'd write).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.moe_flavors import EXPERT_COUNT, GRANULARITY, moe_flavor  # noqa: E402
from benchmarks.vs_torchtitan import measured_run  # noqa: E402
from titan.components.checkpoint.folders import saved_files  # noqa: E402
from titan.tools.loss_compare import command, read_metrics  # noqa: E402

PLUGIN = ["--job.custom_import", "benchmarks/moe_flavors.py"]
DENSE, MOE = "train_configs/debug_model.toml", "train_configs/qwen3_moe_debug.toml"
WARMUP = 3  # steps left out of the medians: allocator and cache warm-up
GIB = 2**30


# ---------------------------------------------------------------------------- the limits


def matmul_flops(threads: int, n: int = 2048, reps: int = 8) -> float:
    """fp32 FLOP/s of an n x n matmul at `threads` threads (median of `reps`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(before)
    return 2 * n**3 / statistics.median(times)


def evict(path: Path) -> None:
    """Drop `path`'s (a file's, or every file's under a folder) pages from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(folder: Path, nbytes: int, chunk: int = 64 * 2**20) -> tuple[float, float]:
    """Sequential write (to the end of fsync) and cold read of one `nbytes` file in `folder`,
    bytes/s."""
    path = folder / "disk_probe.bin"
    block = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // chunk)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = path.stat().st_size / (time.perf_counter() - t0)
    evict(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass
    read = path.stat().st_size / (time.perf_counter() - t0)
    path.unlink()
    return write, read


# ---------------------------------------------------------------------------- training runs


def train(ranks: int, overrides: list[str], dump: Path, config: str, steps: int) -> dict:
    cmd, env = command(
        ranks,
        [
            *PLUGIN,
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--metrics.no_enable_tensorboard",
            "--validation.no_enable",
            *overrides,
        ],
        dump,
        config_file=config,
    )
    log = dump.with_suffix(".log")
    dump.mkdir(parents=True, exist_ok=True)
    run = measured_run(cmd, env, log, timeout=3600)
    later = [r for r in read_metrics(dump) if r["step"] > WARMUP]
    threads = int(env.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // ranks))
    return {
        **run,
        "log": log.read_text(),
        "threads": threads,
        "step_s": statistics.median(r["step_time_s"] for r in later) if later else None,
        "tps": statistics.median(r["tps"] for r in later) * ranks if later else None,
        "tflops": statistics.median(r["tflops"] for r in later) if later else None,
        "memory_gib": max(r["memory_max_gib"] for r in later) if later else None,
    }


def mfu(row: dict, peaks: dict) -> float:
    return row["tflops"] * 1e12 / peaks[row["threads"]]


def training_table(title: str, rows: list[tuple[str, dict]], peaks: dict) -> str:
    out = [
        f"### {title}",
        "",
        "| run | step s | tokens/s | peak memory GiB (rank 0) | TFLOP/s per rank | CPU MFU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        out.append(
            f"| {name} | {r['step_s']:.3f} | {r['tps']:,.0f} | {r['memory_gib']:.2f} | "
            f"{r['tflops']:.3f} | {100 * mfu(r, peaks):.1f}% |"
        )
    return "\n".join(out)


def seq_part(tmp: Path, steps: int, peaks: dict) -> tuple[str, dict]:
    tokens = 4096
    lengths = [128, 256, 512, 1024, 2048]
    rows, curves = [], {}
    for label, config in (("dense", DENSE), ("MoE", MOE)):
        for s in lengths:
            b = tokens // s
            r = train(
                1,
                [
                    "--training.seq_len",
                    str(s),
                    "--training.local_batch_size",
                    str(b),
                    "--training.global_batch_size",
                    str(b),
                ],
                tmp / f"seq-{label}-{s}",
                config,
                steps,
            )
            rows.append((f"{label}, seq {s} x batch {b}", r))
            curves.setdefault(label, []).append((s, r["step_s"], r["memory_gib"], mfu(r, peaks)))
    return training_table(f"Sequence length ({tokens} tokens a step, 1 rank)", rows, peaks), curves


def experts_part(tmp: Path, steps: int, peaks: dict) -> tuple[str, dict]:
    rows, curves = [], {}
    for series, shapes in (("equal total", GRANULARITY), ("width 128", EXPERT_COUNT)):
        for e, k, h in shapes:
            flavor = ["--model.flavor", moe_flavor(e, k, h)]
            r = train(1, flavor, tmp / f"moe-{e}-{k}-{h}", MOE, steps)
            rows.append((f"{series}: {e} experts, top-{k}, width {h}", r))
            curves.setdefault(series, []).append((f"{e}/{k}/{h}", r["step_s"], r["memory_gib"]))
    title = "Experts and top-k at equal active parameters (MoE debug, seq 256 x 8, 1 rank)"
    return training_table(title, rows, peaks), curves


def ep_part(tmp: Path, steps: int, peaks: dict) -> tuple[str, dict]:
    rows, curves = [], {}
    for ranks, eps in ((2, (1, 2)), (4, (1, 2, 4))):
        for ep in eps:
            r = train(
                ranks,
                [
                    "--training.local_batch_size",
                    str(8 // ranks),
                    "--training.global_batch_size",
                    "8",
                    "--parallelism.data_parallel_shard_degree",
                    str(ranks),
                    "--parallelism.expert_parallel_degree",
                    str(ep),
                ],
                tmp / f"ep-{ranks}-{ep}",
                MOE,
                steps,
            )
            rows.append((f"{ranks} ranks (FSDP {ranks}), ep {ep}", r))
            curves.setdefault(f"{ranks} ranks", []).append((ep, r["tps"], r["memory_gib"]))
    title = "Expert parallelism (MoE debug, global batch 8 x 256)"
    return training_table(title, rows, peaks), curves


# ---------------------------------------------------------------------------- checkpoints

SIZES = ["debugmodel", "scaling_170M", "scaling_530M"]
SAVED = re.compile(r"checkpoint step 1 saved \(sync, training blocked ([\d.]+)s\)")
LOADED = re.compile(r"loaded (.*) from .* in ([\d.]+)s")
HF_SAVED = re.compile(r"saved as an HF folder .* in ([\d.]+)s")
HF_LOADED = re.compile(r"from the HF weights .* ([\d.]+) MiB read by this rank .* in ([\d.]+)s")


def _seconds(pattern: re.Pattern, text: str, what: str) -> tuple[str, ...]:
    m = pattern.search(text)
    if m is None:
        raise SystemExit(f"no '{what}' line in the run's log")
    return m.groups()


def checkpoint_part(tmp: Path) -> tuple[str, dict]:
    small = ["--training.seq_len", "128", "--training.local_batch_size", "1"]
    small += ["--training.global_batch_size", "1"]
    rows = []
    for flavor in SIZES:
        dump = tmp / f"ckpt-{flavor}"
        flags = [*small, "--model.flavor", flavor]
        # 1: train a step, save the full state (sync), then the model as an HF folder
        first = train(
            1,
            [*flags, "--checkpoint.enable", "--checkpoint.interval", "1"]
            + ["--checkpoint.last_save_in_hf"],
            dump,
            DENSE,
            2,
        )
        saved, hf = dump / "checkpoint" / "step-1", tmp / f"hf-{flavor}"
        (dump / "checkpoint" / "step-2").rename(hf)
        save_s = float(_seconds(SAVED, first["log"], "saved (sync)")[0])
        # the bytes the save wrote, as its marker records them
        state = sum(size for _, size in saved_files(saved).values())
        # three probes: this VM's disk varies by 2-3x from write to write (write-back)
        probes = [disk_bandwidth(dump, min(max(state, GIB // 4), 4 * GIB)) for _ in range(3)]
        disk_w, disk_r = (statistics.median(p[i] for p in probes) for i in (0, 1))
        spread = [
            (min(p[i] for p in probes) / GIB, max(p[i] for p in probes) / GIB) for i in (0, 1)
        ]
        # 2: resume from step 1, its files cold
        evict(saved)
        second = train(1, [*flags, "--checkpoint.enable"], dump, DENSE, 2)
        what, load_s = _seconds(LOADED, second["log"], "loaded")
        if "optimizer" not in what:
            raise SystemExit(f"the resume loaded {what}, not the optimizer too")
        shutil.rmtree(dump / "checkpoint")
        # 3: a fresh run initialized from the HF folder, cold
        evict(hf)
        third = train(
            1,
            [*flags, "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"],
            tmp / f"hf-run-{flavor}",
            DENSE,
            1,
        )
        mib, hf_s = map(float, _seconds(HF_LOADED, third["log"], "HF weights"))
        shutil.rmtree(hf)
        rows.append(
            {
                "flavor": flavor,
                "state_gib": state / GIB,
                "save_gibs": state / GIB / save_s,
                "load_gibs": state / GIB / float(load_s),
                "hf_gibs": mib / 1024 / hf_s,
                "disk_write_gibs": disk_w / GIB,
                "disk_read_gibs": disk_r / GIB,
                "disk_write_range": spread[0],
                "disk_read_range": spread[1],
                "save_s": save_s,
                "load_s": float(load_s),
                "first_step_s": first["startup_s"],
                "hf_first_step_s": third["startup_s"],
            }
        )
    out = [
        "### Checkpoints (Llama 3, AdamW, 1 rank; sync save with checksums; cold loads)",
        "",
        "| model | state GiB | save s | save GiB/s | disk write GiB/s, median (range) | load s | "
        "load GiB/s | disk read GiB/s, median (range) | HF import GiB/s | launch to step 1 s "
        "(from HF) |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['flavor']} | {r['state_gib']:.2f} | {r['save_s']:.2f} | "
            f"{r['save_gibs']:.2f} | {r['disk_write_gibs']:.2f} ({r['disk_write_range'][0]:.2f}-"
            f"{r['disk_write_range'][1]:.2f}) | {r['load_s']:.2f} | {r['load_gibs']:.2f} | "
            f"{r['disk_read_gibs']:.2f} ({r['disk_read_range'][0]:.2f}-"
            f"{r['disk_read_range'][1]:.2f}) | {r['hf_gibs']:.2f} | "
            f"{r['first_step_s']:.1f} ({r['hf_first_step_s']:.1f}) |"
        )
    return "\n".join(out), {"rows": rows}


# ---------------------------------------------------------------------------- plots


def plot(part: str, curves: dict, folder: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = {  # part -> x label, the two y labels
        "seq": ("sequence length (4096 tokens a step)", "step time s"),
        "experts": ("experts (top-k x width = 256 in both series)", "step time s"),
        "ep": ("expert-parallel degree", "tokens/s (job)"),
    }
    if part in panels:
        xlabel, ylabel = panels[part]
        for label, pts in curves.items():
            # the experts series' points are "experts/top-k/width": plotted at their experts
            xs = [int(str(p[0]).split("/")[0]) for p in pts]
            for ax, i in zip(axes, (1, 2), strict=True):
                ax.plot(xs, [p[i] for p in pts], "o-", label=label)
        for ax in axes:
            ax.set_xlabel(xlabel)
        axes[0].set_ylabel(ylabel)
        axes[1].set_ylabel("peak memory GiB (rank 0 RSS)")
        axes[1].set_ylim(bottom=0)
        if part in ("seq", "experts"):
            for ax in axes:
                ax.set_xscale("log", base=2)
    else:
        rows = curves["rows"]
        x = [r["state_gib"] for r in rows]
        axes[0].plot(x, [r["save_gibs"] for r in rows], "o-", label="sync save")
        axes[0].plot(x, [r["disk_write_gibs"] for r in rows], "k--", label="disk write")
        axes[0].plot(x, [r["load_gibs"] for r in rows], "s-", label="resume load (cold)")
        axes[0].plot(x, [r["hf_gibs"] for r in rows], "^-", label="HF import (cold)")
        axes[0].plot(x, [r["disk_read_gibs"] for r in rows], "k:", label="disk read (cold)")
        axes[0].set_ylabel("GiB/s")
        axes[1].plot(x, [r["first_step_s"] for r in rows], "o-", label="launch to step 1")
        axes[1].plot(x, [r["hf_first_step_s"] for r in rows], "^-", label="... from HF")
        axes[1].set_ylabel("s")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("checkpoint state GiB")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"scaling_{part}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


PARTS = {"seq": seq_part, "experts": experts_part, "ep": ep_part, "checkpoint": checkpoint_part}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"from {', '.join(PARTS)}")
    ap.add_argument("--steps", type=int, default=10, help="steps per training run")
    ap.add_argument("--dir", default=None, help="where runs write (default: a temp folder)")
    ap.add_argument("--plots", default=None, help="write one PNG per curve into this folder")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    cores = os.cpu_count() or 1
    peaks = {t: matmul_flops(t) for t in sorted({max(1, cores // r) for r in (1, 2, 4)})}
    print(
        "fp32 matmul (2048^3), FLOP/s: "
        + ", ".join(f"{t} threads {f / 1e9:.1f} G" for t, f in peaks.items()),
        flush=True,
    )
    results = {"matmul_flops": peaks}
    with tempfile.TemporaryDirectory(prefix="titan-scaling-", dir=args.dir) as tmp:
        for part in parts:
            t0 = time.perf_counter()
            if part == "checkpoint":
                table, curves = checkpoint_part(Path(tmp))
            else:
                table, curves = PARTS[part](Path(tmp), args.steps, peaks)
            print(f"\n{table}\n({part}: {time.perf_counter() - t0:.0f} s)", flush=True)
            results[part] = curves
            if args.plots:
                path = plot(part, curves, Path(args.plots))
                if path:
                    print(f"plot: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
