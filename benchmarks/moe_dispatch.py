"""What expert parallelism costs and saves on CPU: the DeepSeek-V3 debug model (8 routed experts)
on 4 ranks through run_train.sh with expert_parallel_degree 1, 2 and 4, the same global batch,
run interleaved (ep 1, 2, 4, 1, 2, 4, ...) so that machine load falls on every degree alike.

Prints per degree: tokens/s of the whole job (rank 0's `tps` x ranks, median over the steps
after warm-up, then over rounds), the expert weights each rank holds, and the share of a step
that rank 0 spends in dispatch and combine: from a profiler trace of one step, the union of the
spans of the expert_parallel.dispatch/combine labels, the all-to-all ops and the waits on them
(their backward included) on the training thread, over the ProfilerStep span.

    python benchmarks/moe_dispatch.py [--rounds 3 --steps 12 --seq-len 256]
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titan.tools.loss_compare import launch, read_metrics  # noqa: E402

CONFIG = "train_configs/deepseek_v3_debug.toml"
RANKS = 4
DEGREES = (1, 2, 4)
# the forward's dispatch/combine spans (the counts' exchange, which waits for the slowest ep
# rank, the rows' all-to-all and their reordering) and the backward's all-to-alls
ALL_TO_ALL = re.compile(r"expert_parallel\.|all_to_all|alltoall|wait_tensor")


def run(ep: int, args, dump: Path) -> dict:
    # the profiler traces the last step, after steps-1 untraced ones
    launch(
        RANKS,
        [
            "--training.steps",
            str(args.steps),
            "--training.seq_len",
            str(args.seq_len),
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "8",
            "--metrics.no_enable_tensorboard",
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            str(args.steps),
            "--profiling.profiler_warmup",
            "1",
            "--profiling.profiler_active",
            "1",
        ],
        dump,
        config_file=CONFIG,
        timeout=900,
    )
    records = read_metrics(dump)
    steady = [r["tps"] * RANKS for r in records[args.warmup :]]
    trace = next((dump / "profile_traces").glob("iteration_*/rank0_trace.json"))
    return {"tps": statistics.median(steady), "a2a_share": all_to_all_share(trace)}


def all_to_all_share(trace: Path) -> float:
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    step = max((e for e in events if e["name"].startswith("ProfilerStep")), key=lambda e: e["dur"])
    thread = (step["pid"], step["tid"])
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if (e["pid"], e["tid"]) == thread
        and ALL_TO_ALL.search(e["name"])
        and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # union: nested spans (an op inside its autograd node) once
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / step["dur"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    results: dict[int, list[dict]] = {ep: [] for ep in DEGREES}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for ep in DEGREES:
                results[ep].append(run(ep, args, Path(scratch) / f"ep{ep}_{r}"))
                print(f"round {r + 1} ep {ep}: {results[ep][-1]}", file=sys.stderr)
    print(
        f"| ep | experts per rank | tokens/s ({RANKS} ranks, median of {args.rounds}) "
        "| vs ep 1 | step share in dispatch + combine (rank 0) |"
    )
    print("|---:|---:|---:|---:|---:|")
    base = statistics.median(r["tps"] for r in results[1])
    for ep in DEGREES:
        tps = statistics.median(r["tps"] for r in results[ep])
        share = statistics.median(r["a2a_share"] for r in results[ep])
        print(f"| {ep} | {8 // ep} | {tps:,.0f} | {tps / base:.2f} | {share:.1%} |")


if __name__ == "__main__":
    main()
