"""Where two traced steps spend their time: torch profiler traces side by side, op by op.

    python benchmarks/trace_compare.py A/rank0_trace.json B/rank0_trace.json [--top 30]

Each trace is one profiled step (titan's and torchtitan's `profiling.enable_profiling` write
one per rank). For every CPU op the self time (its time minus the ops it called) is summed,
on the thread that ran the step and on the others (autograd's backward thread, collectives);
ops are also grouped into kinds (matmul, attention, collectives, optimizer, ...), so the table
says which kind of work makes up a step-time difference. Python-level calls (`python_function`
events, present only with stack tracing) are left out: their time is in the ops they ran.
"""

import argparse
import gzip
import json
import re
from collections import defaultdict

KINDS = [  # first match wins
    (
        "collectives",
        r"c10d|gloo|nccl|all_reduce|all_gather|reduce_scatter|broadcast|_allgather|"
        r"record_param_comms|wait_tensor|FSDP::|_to_copy.*comm",
    ),
    ("optimizer", r"adam|_foreach|optimizer"),
    ("attention", r"attention|sdpa|_scaled_dot|flash|_efficient"),
    ("matmul", r"^aten::(mm|bmm|addmm|matmul|linear|baddbmm|_grouped_mm)$|^titan::grouped_mm$"),
    (
        "copies/layout",
        r"copy|clone|contiguous|cat|stack|expand|repeat|index|view|reshape|"
        r"transpose|permute|t$|split|chunk|narrow|slice|select|unbind|_unsafe|"
        r"as_strided|empty|zeros|ones|fill|new_|to$|detach|alias|squeeze",
    ),
    ("loss", r"cross_entropy|log_softmax|nll_loss|_log_softmax"),
    ("norm", r"rms_norm|_fused_rms|rsqrt|norm"),
]


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.I):
            return kind
    return "elementwise/other"


def self_times(events: list[dict]) -> tuple[dict[str, float], float]:
    """Self microseconds per op name, and the step's wall time (its ProfilerStep span)."""
    step = max(
        (e["dur"] for e in events if e.get("name", "").startswith("ProfilerStep")), default=0.0
    )
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cpu_op", "user_annotation")
        and not e["name"].startswith("ProfilerStep")
    ]
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[(e["pid"], e["tid"])].append(e)
    totals: dict[str, float] = defaultdict(float)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self time so far]
        for e in thread_ops:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, own = stack.pop()
                totals[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, own in stack:
            totals[name] += own
    # the step's own spans enclose everything: their self time is Python between ops. FSDP's
    # spans stay: their self time is FSDP's own work around its collectives
    return {n: t for n, t in totals.items() if "#" not in n and not n.startswith("## ")}, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--names", default="A,B", help="column names for the two traces")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    na, nb = args.names.split(",")
    (ta, step_a), (tb, step_b) = self_times(load(args.a)), self_times(load(args.b))
    print(f"step wall time: {na} {step_a / 1e3:.1f} ms, {nb} {step_b / 1e3:.1f} ms\n")
    kinds_a, kinds_b = defaultdict(float), defaultdict(float)
    for n, t in ta.items():
        kinds_a[kind_of(n)] += t
    for n, t in tb.items():
        kinds_b[kind_of(n)] += t
    print(f"| kind | {na} ms | {nb} ms | {na} - {nb} |\n|---|---:|---:|---:|")
    for k in sorted(set(kinds_a) | set(kinds_b), key=lambda k: -(kinds_a[k] + kinds_b[k])):
        print(
            f"| {k} | {kinds_a[k] / 1e3:.1f} | {kinds_b[k] / 1e3:.1f} | "
            f"{(kinds_a[k] - kinds_b[k]) / 1e3:+.1f} |"
        )
    print(
        f"\n| op (self time, all threads) | {na} ms | {nb} ms | {na} - {nb} |\n|---|---:|---:|---:|"
    )
    names = sorted(set(ta) | set(tb), key=lambda n: -abs(ta.get(n, 0) - tb.get(n, 0)))
    for n in names[: args.top]:
        a, b = ta.get(n, 0.0), tb.get(n, 0.0)
        print(f"| {n} | {a / 1e3:.1f} | {b / 1e3:.1f} | {(a - b) / 1e3:+.1f} |")


if __name__ == "__main__":
    main()
