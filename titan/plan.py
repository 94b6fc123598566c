"""Plan a run's memory before launching it: `python -m titan.plan [run_train.sh's config and
overrides] --ngpu N [--nnodes M] [--device-memory 80GiB] [--json]`.

For each pipeline rank (ranks of one pipeline rank differ only by a few elements of an uneven
FSDP shard; the one shown, the first, holds the largest), the bytes of parameters, gradients
and optimizer states, computed from the model parts that rank builds (`titan.memory_plan`):
they equal what the trainer measures (`memory_measured.json`). Activations and transient
buffers are not estimated yet, so the total is a floor, and the headroom an upper bound.
"""

import argparse
import json
import os
import re
import sys

from titan.config import ConfigError, parse_args
from titan.memory_plan import human_bytes, pipeline_rank_bytes

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GiB or 141GB")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def plan(job, world_size: int, device_memory: int | None) -> dict:
    from titan.preflight import plan_run

    dims = plan_run(job, world_size).dims
    ranks = [{"rank": rank, "pp_rank": pp_rank, **b, "states_bytes": sum(b.values())}
             for rank, pp_rank, b in pipeline_rank_bytes(job, world_size)]
    worst = max(r["states_bytes"] for r in ranks)
    return {
        "world_size": world_size,
        "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                   "tp": dims.tp, "pp": dims.pp},
        "model": {"name": job.model.name, "flavor": job.model.flavor},
        "ranks": ranks,
        "max_states_bytes": worst,
        "device_memory_bytes": device_memory,
        "headroom_bytes": None if device_memory is None else device_memory - worst,
        "not_included": ["activations", "transient buffers"],
    }


def render(report: dict) -> str:
    lay = report["layout"]
    lines = [f"{report['model']['name']} {report['model']['flavor']} on {report['world_size']} "
             f"ranks: " + ", ".join(f"{k} {v}" for k, v in lay.items()),
             f"{'rank':>6} {'pp':>3} {'params':>12} {'grads':>12} {'optimizer':>12} "
             f"{'states':>12}"]
    for r in report["ranks"]:
        lines.append(f"{r['rank']:>6} {r['pp_rank']:>3} {human_bytes(r['params_bytes']):>12} "
                     f"{human_bytes(r['grads_bytes']):>12} {human_bytes(r['optimizer_bytes']):>12} "
                     f"{human_bytes(r['states_bytes']):>12}")
    if report["device_memory_bytes"] is not None:
        lines.append(f"device memory {human_bytes(report['device_memory_bytes'])}: headroom at most "
                     f"{human_bytes(report['headroom_bytes'])} per rank")
    lines.append("not included yet: activations and transient buffers (the states are a floor)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ngpu", type=int, default=1, help="ranks per node (NGPU of run_train.sh)")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes")
    ap.add_argument("--device-memory", type=parse_bytes, default=None,
                    help="memory of one device, e.g. 80GiB: prints the headroom")
    ap.add_argument("--json", action="store_true", help="print JSON (keys: see README)")
    args, rest = ap.parse_known_args(argv)
    if not any(a.startswith("--job.config_file") for a in rest):
        rest = ["--job.config_file",
                os.environ.get("CONFIG_FILE", "train_configs/debug_model.toml"), *rest]
    try:
        report = plan(parse_args(rest), args.ngpu * args.nnodes, args.device_memory)
    except ConfigError as e:
        print(f"titan: config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
