"""Where traced steps spend their time: torch profiler traces side by side, op by op.

    python benchmarks/trace_compare.py A/rank0_trace.json [B/rank0_trace.json] [--top 30]
    python benchmarks/trace_compare.py A.json B.json --kernels    # the GPU's side

`--kernels` sums the device's kernels instead (a GPU trace), by kernel name and kind (GEMMs,
grouped GEMMs, attention, the optimizer, the gradient norm, casts and copies, routing's sorts
and gathers, compiled fusions), with the time the GPU was busy at all against the step's wall
time: a GPU idle for part of the step waits on the host.

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


# kernel names, first match wins: cuBLAS/CUTLASS/nvjet GEMMs, FlashAttention/cuDNN, torch's
# multi-tensor kernels (fused Adam, foreach norm and scale), inductor's triton_* fusions
KERNEL_KINDS = [
    ("grouped GEMM", r"grouped|GroupProblemShape|Grouped"),
    ("attention", r"flash|fmha|attention|Attention|cudnn.*sdpa"),
    ("GEMM", r"gemm|Gemm|GEMM|nvjet|xmma|cutlass|cublas|sm90_|sm80_"),
    ("optimizer", r"Adam|adam|SGD|Muon"),
    ("grad norm and clip", r"LpNorm|lpnorm|multi_tensor_apply"),
    ("memcpy/memset", r"^Memcpy|^Memset|^memcpy|^memset"),
    ("compiled fusions (triton)", r"^triton_"),
    ("sort/index/scatter (routing)", r"sort|Sort|radix|topk|index|scatter|gather|cub::|Cub"),
    ("casts and copies", r"copy|Copy|CatArray|cat_"),
    ("reductions", r"reduce|Reduce"),
]


def kernel_kind(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, name):
            return kind
    return "elementwise/other"


def kernel_times(events: list[dict]) -> tuple[dict[str, tuple[float, int]], float, float]:
    """Microseconds and launches per kernel name, the microseconds the device was busy (the
    union of its kernels' spans: overlapping streams count once) and the step's wall time."""
    step = max(
        (e["dur"] for e in events if e.get("name", "").startswith("ProfilerStep")), default=0.0
    )
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        totals[e["name"]][0] += e["dur"]
        totals[e["name"]][1] += 1
    busy, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            busy += stop - start
        end = max(end, stop)
    return {n: (t, c) for n, (t, c) in totals.items()}, busy, step


def kernel_time_by_kind(times: dict[str, tuple[float, int]]) -> dict[str, float]:
    """kernel_times' microseconds summed by kernel kind, the largest first."""
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in times.items():
        kinds[kernel_kind(name)] += us
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def kernels_report(paths: list[str], names: list[str], top: int) -> str:
    """The markdown tables of --kernels for one or more traces."""
    measured = [kernel_times(load(p)) for p in paths]
    if not any(times for times, _, _ in measured):
        return "no GPU kernels in the trace(s): profile a GPU run (this one ran on the CPU)"
    lines = []
    for n, (times, busy, step) in zip(names, measured):
        total = sum(t for t, _ in times.values())
        lines.append(
            f"{n}: step {step / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms "
            f"({100 * busy / step if step else 0:.0f}%), kernels {total / 1e3:.1f} ms in "
            f"{sum(c for _, c in times.values())} launches"
        )
    kinds = [defaultdict(float, kernel_time_by_kind(times)) for times, _, _ in measured]
    cols = " | ".join(f"{n} ms" for n in names)
    lines += ["", f"| kind | {cols} |", "|---" + "|---:" * len(names) + "|"]
    for k in sorted(set().union(*kinds), key=lambda k: -sum(d[k] for d in kinds)):
        lines.append(f"| {k} | " + " | ".join(f"{d[k] / 1e3:.2f}" for d in kinds) + " |")
    cols = " | ".join(f"{n} ms (launches)" for n in names)
    lines += ["", f"| kernel | kind | {cols} |", "|---|---" + "|---:" * len(names) + "|"]
    every = set().union(*(times for times, _, _ in measured))
    for name in sorted(every, key=lambda k: -max(m[0].get(k, (0, 0))[0] for m in measured))[:top]:
        cells = []
        for times, _, _ in measured:
            t, c = times.get(name, (0.0, 0))
            cells.append(f"{t / 1e3:.2f} ({c})")
        lines.append(f"| {_short(name)} | {kernel_kind(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b", nargs="?", default=None)
    ap.add_argument("--names", default="A,B", help="column names for the two traces")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--kernels", action="store_true", help="the GPU's kernels instead of the host's ops"
    )
    args = ap.parse_args(argv)
    paths = [p for p in (args.a, args.b) if p]
    names = args.names.split(",")[: len(paths)]
    if args.kernels:
        print(kernels_report(paths, names, args.top))
        return
    if len(paths) == 1:
        ap.error("the host's ops compare two traces; one trace: --kernels")
    na, nb = names
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
