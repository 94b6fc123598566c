"""Plan a run's memory before launching it: `python -m titan.planner [run_train.sh's config and
overrides] --ngpu N [--nnodes M] [--device-memory 80GiB] [--json]`.

For each pipeline rank (ranks of one pipeline rank differ only by a few elements of an uneven
FSDP shard; the one shown, the first, holds the largest), the bytes of parameters, gradients
and optimizer states, computed from the model parts that rank builds (`titan.planner.memory`):
they equal what the trainer measures (`memory_measured.json`); the activations held for
backward at the peak, traced through the same parts on fake tensors (the trainer measures
them too); and transient buffers (FSDP's gathered units, the logits' gradient), estimated.

`--suggest` ranks the layouts for the GPUs given instead (`titan.planner.layout_search`).
"""

import argparse
import json
import re
import sys

from titan.config import ConfigError, parse_args, with_config_file
from titan.planner.layout_search import Hardware, suggest
from titan.planner.memory import device_memory_bytes, human_bytes, pipeline_rank_bytes
from titan.runtime.console import plural

# the largest world the planner builds meshes for (8 MiB a mesh of int64 ranks); no run is
# larger, and a mesh of 10^9 ranks alone would take 8 GB
MAX_RANKS = 2**20

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GiB or 141GB")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def plan(job, run, device_memory: int | None) -> dict:
    """The report of the job's RunPlan `run`."""
    dims = run.dims
    ranks = [
        {"rank": rank, "pp_rank": pp_rank, **b}
        for rank, pp_rank, b in pipeline_rank_bytes(job, run, worst_routing=True)
    ]
    worst = max(r["total_bytes"] for r in ranks)
    return {
        "world_size": dims.world_size,
        "layout": {**dims.degrees(), "ep": dims.ep},
        "model": {
            "name": job.model.name,
            "flavor": job.model.flavor,
            "vocab_size": run.model_args.vocab_size,
        },
        "activation_checkpoint": job.activation_checkpoint.mode,
        "ranks": ranks,
        "max_states_bytes": max(r["states_bytes"] for r in ranks),
        "max_total_bytes": worst,
        "device_memory_bytes": device_memory,
        "headroom_bytes": None if device_memory is None else device_memory - worst,
    }


_COLUMNS = ("params", "grads", "optimizer", "activations", "transient", "total")


def render(report: dict) -> str:
    lay = report["layout"]
    model = report["model"]
    lines = [
        f"{model['name']} {model['flavor']} (vocabulary {model['vocab_size']}) on "
        f"{plural(report['world_size'], 'rank')}: "
        + ", ".join(f"{k} {v}" for k, v in lay.items())
        + f"; activation checkpointing {report['activation_checkpoint']}",
    ]
    # the weights' copies (an [ema] average) get a column where a run keeps them
    columns = _COLUMNS
    if any(r.get("copies_bytes") for r in report["ranks"]):
        columns = (*_COLUMNS[:3], "copies", *_COLUMNS[3:])
    lines.append(f"{'rank':>6} {'pp':>3} " + " ".join(f"{c:>12}" for c in columns))
    for r in report["ranks"]:
        cells = [r[f"{c}_bytes"] for c in columns]
        lines.append(
            f"{r['rank']:>6} {r['pp_rank']:>3} "
            + " ".join(f"{'?' if v is None else human_bytes(v):>12}" for v in cells)
        )
        if r.get("activations_error"):
            lines.append(f"       activations not traced: {r['activations_error']}")
        if r.get("worst_routing_error"):
            lines.append(f"       imbalanced routing not traced: {r['worst_routing_error']}")
    worst = max(report["ranks"], key=lambda r: r.get("worst_routing_bytes") or 0)
    if worst.get("worst_routing_bytes"):
        lines.append(
            f"imbalanced routing: at most {human_bytes(worst['worst_routing_bytes'])} "
            f"on rank {worst['rank']} if one rank's experts received every token of "
            f"its {lay['ep']} ep ranks in every MoE layer (above: balanced)"
        )
    if report["device_memory_bytes"] is not None:
        headroom = report["headroom_bytes"]
        lines.append(
            f"device memory {human_bytes(report['device_memory_bytes'])}: "
            + (
                f"fits, headroom {human_bytes(headroom)} on the fullest rank"
                if headroom >= 0
                else f"does NOT fit: the fullest rank needs {human_bytes(-headroom)} more"
            )
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m titan.planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ngpu", type=int, default=1, help="ranks per node (NGPU of run_train.sh)")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes")
    ap.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        help="memory of one device, e.g. 80GiB: prints the headroom",
    )
    ap.add_argument("--json", action="store_true", help="print JSON (keys: see README)")
    ap.add_argument(
        "--suggest",
        action="store_true",
        help="rank the layouts of these GPUs that fit (needs --device-memory)",
    )
    ap.add_argument("--top", type=int, default=5, help="--suggest: layouts to show")
    ap.add_argument(
        "--margin", type=float, default=0.1, help="--suggest: share of the device memory left free"
    )
    hw = Hardware()
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=hw.peak_flops / 1e12,
        help="--suggest: dense bf16 peak of one GPU",
    )
    ap.add_argument(
        "--efficiency",
        type=float,
        default=hw.efficiency,
        help="--suggest: share of the peak matmuls reach",
    )
    ap.add_argument(
        "--intra-node-gbps",
        type=float,
        default=hw.intra_node_bw / 1e9,
        help="--suggest: GB/s per GPU inside a node",
    )
    ap.add_argument(
        "--inter-node-gbps",
        type=float,
        default=hw.inter_node_bw / 1e9,
        help="--suggest: GB/s per GPU across nodes",
    )
    return ap


def _check_flags(args) -> None:
    """ConfigError for a planner flag out of its range."""
    for flag, value in (("--ngpu", args.ngpu), ("--nnodes", args.nnodes)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1 ({flag} 1 plans one process)")
    if args.ngpu * args.nnodes > MAX_RANKS:
        raise ConfigError(
            f"--ngpu {args.ngpu} x --nnodes {args.nnodes} = "
            f"{args.ngpu * args.nnodes} ranks: the planner plans up to "
            f"{MAX_RANKS} ranks; pass the sizes of a real cluster"
        )
    if args.device_memory is not None and args.device_memory <= 0:
        raise ConfigError(f"--device-memory {args.device_memory} bytes: must be > 0 (e.g. 80GiB)")
    for flag, ok, why in (
        ("--top", args.top >= 1, "must be >= 1 (layouts to show)"),
        ("--margin", 0 <= args.margin < 1, "must be in [0, 1) (a share of device memory)"),
        ("--peak-tflops", args.peak_tflops > 0, "must be > 0 (e.g. 989 for an H100's bf16)"),
        ("--efficiency", 0 < args.efficiency <= 1, "must be in (0, 1] (a share of peak)"),
        ("--intra-node-gbps", args.intra_node_gbps > 0, "must be > 0"),
        ("--inter-node-gbps", args.inter_node_gbps > 0, "must be > 0"),
    ):
        if not ok:
            raise ConfigError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: {why}")


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    rest = with_config_file(rest)
    try:
        _check_flags(args)
        job = parse_args(rest)
        job.plan_only = True
        from titan.plan.run_plan import plan_run, vocabulary_note

        run = plan_run(job, args.ngpu * args.nnodes)
        note = vocabulary_note(job, run)
        if note:
            print(f"titan: note: {note}", file=sys.stderr, flush=True)
        if args.suggest:
            memory = args.device_memory or device_memory_bytes(job)
            if memory is None:
                raise ConfigError(
                    "--suggest needs the memory of one device: pass "
                    "--device-memory (e.g. 80GiB) or memory.device_memory_gib"
                )
            hw = Hardware(
                args.peak_tflops * 1e12,
                args.efficiency,
                args.intra_node_gbps * 1e9,
                args.inter_node_gbps * 1e9,
                args.ngpu,
            )
            found = suggest(job, run, memory, hw, args.margin, args.top)
            print(
                json.dumps(suggestions_json(found, memory), indent=1)
                if args.json
                else render_suggestions(found, memory, args.ngpu * args.nnodes)
            )
            return 0 if found else 1
        report = plan(job, run, args.device_memory)
    except ConfigError as e:
        print(f"titan: config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else render(report))
    fits = report["headroom_bytes"] is None or report["headroom_bytes"] >= 0
    return 0 if fits else 1


def suggestions_json(found: list, memory: int) -> dict:
    return {
        "device_memory_bytes": memory,
        "layouts": [
            {
                "layout": c.layout,
                "activation_checkpoint": c.ac,
                "local_batch_size": c.local_batch_size,
                "grad_accum_steps": c.grad_accum,
                "peak_bytes": c.peak_bytes,
                "step_s": c.step_s,
                "step_parts_s": c.parts,
                "overrides": c.overrides(),
            }
            for c in found
        ],
    }


def _cp_type(layout: dict) -> str:
    if layout["cp_type"] == "hybrid":
        return f"hybrid, all-to-all in groups of {layout['cp_a2a']}"
    return layout["cp_type"]


def render_suggestions(found: list, memory: int, world_size: int) -> str:
    if not found:
        return (
            f"no layout of {plural(world_size, 'rank')} fits {human_bytes(memory)} per device with "
            "the margin: add devices, bf16 optimizer states or a smaller seq_len"
        )
    lines = [
        f"layouts of {plural(world_size, 'rank')} that fit {human_bytes(memory)}, fastest first "
        "(step-time model: python -m titan.planner --help, README):"
    ]
    for i, c in enumerate(found, 1):
        lay = (
            ", ".join(
                f"{k} {v}" if k != "cp" else f"cp {v} ({_cp_type(c.layout)})"
                for k, v in c.layout.items()
                if k not in ("cp_type", "cp_a2a") and v > 1
            )
            or "1 rank"
        )
        why = ", ".join(f"{k} {v:.3g} s" for k, v in c.parts.items() if v > 0)
        lines += [
            f"{i}. {lay}; AC {c.ac}; local batch {c.local_batch_size} "
            f"(accumulating {c.grad_accum}); peak {human_bytes(c.peak_bytes)}; "
            f"step ~{c.step_s:.3g} s ({why})",
            "   " + " ".join(c.overrides()),
        ]
    return "\n".join(lines)
