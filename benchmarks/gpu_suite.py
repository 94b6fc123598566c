"""The GPU suite: one command that measures titan on one GPU against torchtitan, and the
checks that need a GPU. Rows (each a fresh trainer process, titan and torchtitan interleaved):

- train/peer (MoE, first): DeepSeek-V3 at Moonlight-16B-A3B's shape (64 routed experts, 6 a
  token, 2 shared) and Qwen3-30B-A3B's (128 experts, 8 a token), each cut to 4 layers, bf16,
  selective AC, expert parallelism 1, batch 4 (--moe-batch), eager then compiled, each
  followed by torchtitan on the same shape; --profile traces a step of each and sums its GPU
  kernels by kind;
- train/peer: Llama 3 8B cut to --cut-layers layers and Llama 3 1B, seq_len 8192, bf16,
  torch.compile; selective (per-op) vs full AC; float8 (rowwise) vs bf16. Each titan row is
  followed by torchtitan on the same shape, batch, seq_len, AC, compile and dtype: tokens/s
  and peak memory ratios titan/torchtitan (targets >= 1.05x and <= 1.0x), MFU against the
  datasheet bf16 peak and against a bf16 8192^3 matmul measured here (target >= 45% bf16 at
  the 8B shape, datasheet). Both use the bundled tokenizer (vocabulary 2048) and corpus. On
  one GPU titan (dp_shard 1) applies no FSDP and computes bf16 under autocast; torchtitan
  0.2 does the same, 0.3 wraps a one-rank FSDP (see gpu_suite_torchtitan.py);
- checkpoint: training blocked by an async (pinned-memory) save vs a sync save (< 10%);
- tests: the 1-GPU CUDA tests (TITAN_TEST_DEVICE=cuda pytest -m "integration or gpu", a
  selection: see --tests), among them the CUDA-only observability checks: memory snapshots
  every profile_freq steps and on an out-of-memory error, and the NCCL flight recorder
  keeping a rank's collectives (tests/unit/test_observability.py).
It prints a markdown table and writes the figures as JSON (--out). A row that fails is
reported as such and the suite goes on; the exit code is 1 if any did.

On the lent GPU machine (Python 3.12, torch 2.11, no network): here, once,
`bash scripts/gpu_wheels.sh` (titan's data stack, torchao, torchtitan 0.2.2: 0.3.0 needs a
newer torch than 2.11), then device-tool calls (carry [".whl"]). On an H100/H200 each row takes
30-75 s (the compiled ones included), about 14 minutes for all 19; rows run in order of
importance, and `--budget` stops the suite in time, reporting the rest as skipped (the JSON is
written after every row):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
      PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out $OUT/gpu_suite.json

CI runs the dry run, which takes every path of the suite on the CPU with debug-sized models
(fp32, a few steps; float8 emulated; async saves without pinned memory) in about a minute:
    python benchmarks/gpu_suite.py --device cpu --tiny
"""

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import gpu_suite_report as report  # noqa: E402
import gpu_suite_titan as titan_side  # noqa: E402
import gpu_suite_torchtitan as peer_side  # noqa: E402
import trace_compare  # noqa: E402
from gpu_suite_rows import model_args, plan, profile_flags  # noqa: E402

from titan.runtime.paths import REPO_ROOT  # noqa: E402
from titan.tools.loss_compare import read_metrics  # noqa: E402

KINDS = ("train", "peer", "checkpoint", "tests")
PEAK_CODE = """
import importlib, json, sys, torch
from titan.components.observability.flops import gpu_peak_flops, measure_matmul_flops
missing = {}
for name in ("datasets", "torchdata", "torchao"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing[name] = f"{type(e).__name__}: {e}"
dev, n = torch.device(sys.argv[1]), int(sys.argv[2])
dtype = getattr(torch, sys.argv[3])
name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
print(json.dumps({"device_name": name, "torch": torch.__version__,
    "datasheet_flops": gpu_peak_flops(name) if dev.type == "cuda" else None,
    "matmul_flops": measure_matmul_flops(dev, dtype, n=n, iters=10 if dev.type == "cuda" else 3),
    "memory_gib": torch.cuda.get_device_properties(dev).total_memory / 2**30
                  if dev.type == "cuda" else None, "missing": missing}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="where the rows run (default cuda; cpu only with --tiny)",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="the dry run: debug-sized stand-ins for every row, a few fp32 steps",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON file for the figures (default outputs/gpu_suite/<device>[_tiny].json)",
    )
    ap.add_argument(
        "--rows",
        default=",".join(KINDS),
        help=f"comma-separated row kinds to run, of {','.join(KINDS)} (default all)",
    )
    ap.add_argument(
        "--cut-layers",
        type=int,
        default=8,
        help="layers of the 8B shape: 8 keep model, AdamW state and seq_len-8192 "
        "activations within an 80 GB H100 in every row (default 8)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per train/peer row (default 20; tiny 6)",
    )
    ap.add_argument(
        "--peer-attention",
        choices=["flex", "sdpa"],
        default="flex",
        help="torchtitan 0.3's attention on the GPU: flex (what it ships for its "
        "language models) or causal SDPA (titan's kernels); CPU: always sdpa",
    )
    ap.add_argument(
        "--peer-args",
        default="",
        help="extra torchtitan CLI overrides for every peer row, e.g. "
        "'--training.disable_cuda_graphs'",
    )
    ap.add_argument(
        "--tests",
        default=None,
        help="pytest arguments of the tests row (default: the gpu-marked tests and "
        "the debug model's learning run; tiny: one preflight test)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one row may take before it is killed (default 300; tiny 180)",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated parts of row names: run only the rows whose name holds one, "
        "e.g. 'DeepSeek,save' (default every row of --rows)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds the whole suite may take: a row still running then is stopped, later "
        "rows are reported as skipped (rows run in order of importance; default no limit)",
    )
    ap.add_argument(
        "--moe-batch",
        type=int,
        default=4,
        help="local batch of the MoE rows (default 4). One GPU updates all of a 2B-parameter "
        "MoE's weights each step, which at dp_shard 8 would be split 8 ways: at batch 1 "
        "AdamW, the gradient norm and the weight casts (work of the parameter count) are a "
        "third of the step, at batch 4 a tenth, as a rank's share is at scale",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="trace one step after the timed ones in every train/peer row (both sides' "
        "profiling.enable_profiling): each trace is kept gzipped beside --out, in traces/, and "
        "its GPU kernels are summed by kind (benchmarks/trace_compare.py --kernels)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows' dump folders (logs, metrics, checkpoints)",
    )
    args = ap.parse_args(argv)
    kinds = set(args.rows.split(","))
    if not kinds <= set(KINDS):
        ap.error(f"--rows {args.rows!r}: kinds are {', '.join(KINDS)}")
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu runs only the dry run: add --tiny")
    args.kinds = kinds
    args.timeout = args.timeout or (180 if args.tiny else 300)
    args.out = Path(
        args.out
        or REPO_ROOT / "outputs" / "gpu_suite" / f"{args.device}{'_tiny' if args.tiny else ''}.json"
    )
    return args


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # no network on the GPU machine; the bundled corpus and tokenizer are local
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # one rank: every core
    return env


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (torchrun starts workers in new sessions)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, doomed = [pid], []
    while todo:
        p = todo.pop()
        doomed.append(p)
        todo += parents.get(p, [])
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, str]:
    """Run to completion or `timeout`; returns (exit code, last lines); the whole output goes
    to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            code = 124
    tail = log.read_text(errors="replace").splitlines()[-60:]
    return code, "\n".join(tail)


def failure(code: int, tail: str, timeout: float) -> str:
    """A one-line status; the row keeps the log's last lines (`log_tail`) besides."""
    if code == 124:
        return f"failed: timed out after {timeout:.0f} s"
    errors = [ln for ln in tail.splitlines() if re.search(r"Error|error:|Exception", ln)]
    return f"failed (exit {code}): {(errors or tail.splitlines() or ['?'])[-1].strip()}"


def peer_inputs(work: Path) -> tuple[Path, Path]:
    """torchtitan's tokenizer folder and its one-document corpus (see gpu_suite_torchtitan)."""
    tok, data = work / "peer_tokenizer", work / "peer_data"
    tok.mkdir(exist_ok=True)
    data.mkdir(exist_ok=True)
    src = REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"
    (tok / "tokenizer.json").write_bytes(src.read_bytes())
    (tok / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    corpus = REPO_ROOT / "assets" / "corpus" / "kjv_train.jsonl"
    text = "\n\n".join(json.loads(x)["text"] for x in corpus.read_text().splitlines() if x)
    (data / "train.jsonl").write_text(json.dumps({"text": text}) + "\n")
    return tok, data


def run_row(row, ctx: dict, timeout: float) -> dict:
    res = {**row.as_dict(), "status": "ok"}
    dump = ctx["work"] / f"{len(ctx['done']):02d}_{row.kind}"
    env, args, peaks = ctx["env"], ctx["args"], ctx["peaks"]
    t0 = time.perf_counter()
    # profiled: two steps more, the first the profiler's warm-up, the second traced; the
    # timed steps stay those of the row
    profiled = args.profile and row.kind in ("train", "peer")
    ran = dataclasses.replace(row, steps=row.steps + 2) if profiled else row
    if row.kind in ("train", "checkpoint"):
        margs = model_args(row.shape, ctx["vocab"], row.seq_len, row.model)
        peak = peaks["datasheet"] or peaks["matmul"]
        extra = profile_flags(ran.steps) if profiled else []
        code, tail = run(
            titan_side.command(ran, dump, peak, args.device) + extra,
            env,
            dump / "console.log",
            timeout,
        )
        if code != 0:
            res["status"], res["log_tail"] = failure(code, tail, timeout), tail
        elif row.kind == "train":
            res.update(
                report.training_figures(
                    read_metrics(dump),
                    row.warmup,
                    margs.flops_per_token(row.seq_len),
                    peaks,
                    last=row.steps,
                )
            )
        else:
            res.update(report.checkpoint_figures(titan_side.read_checkpoint_times(dump)))
            if row.checkpoint_mode != "disabled" and not res["ran_async"]:
                # the checkpointer falls back to sync saves when /dev/shm cannot stage them
                res["status"] = "ok, but the saves ran synchronously (see its console.log)"
    elif row.kind == "peer":
        if ctx["peer_status"]:
            res["status"] = ctx["peer_status"]
        else:
            margs = model_args(row.shape, ctx["vocab"], row.seq_len, row.model)
            spec = peer_side.peer_spec(
                ran, margs, args.device, *ctx["peer_inputs"], dump, args.peer_attention
            )
            extra = shlex.split(args.peer_args)
            extra += profile_flags(ran.steps) if profiled else []
            cmd, extra_env = peer_side.command(spec, extra)
            code, tail = run(cmd, {**env, **extra_env}, dump / "console.log", timeout)
            if code != 0:
                res["status"], res["log_tail"] = failure(code, tail, timeout), tail
            else:
                res.update(
                    report.training_figures(
                        peer_side.read_metrics(dump),
                        row.warmup,
                        margs.flops_per_token(row.seq_len),
                        peaks,
                        last=row.steps,
                    )
                )
            res["torchtitan"] = ctx["peer_version"]
    else:
        # one test at a time on the one GPU: without the suite's -n (the GPU machine may have
        # no pytest-xdist)
        cmd = [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"),
            *row.pytest_args,
        ]
        code, tail = run(
            cmd, {**env, "TITAN_TEST_DEVICE": args.device}, dump / "console.log", timeout
        )
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|deselected)", tail)
        res["counts"] = {k: int(n) for n, k in counts}
        res["summary"] = ", ".join(f"{n} {k}" for n, k in counts) or "no summary"
        if code != 0:
            res["status"], res["log_tail"] = failure(code, tail, timeout), tail
    if profiled and res["status"] == "ok":
        res.update(
            keep_trace(dump, args.out.parent / "traces", f"{len(ctx['done']):02d}_{row.kind}")
        )
    res["wall_s"] = time.perf_counter() - t0
    return res


def keep_trace(dump: Path, folder: Path, name: str) -> dict:
    """The row's traced step, gzipped into `folder`, and its GPU kernels by kind (ms)."""
    traces = sorted(dump.rglob("rank0_trace.json"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return {"trace": None}
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / f"{name}.json.gz"
    with open(traces[-1], "rb") as src, gzip.open(kept, "wb") as dst:
        shutil.copyfileobj(src, dst)
    times, busy, step = trace_compare.kernel_times(trace_compare.load(str(kept)))
    kinds = trace_compare.kernel_time_by_kind(times)
    return {
        "trace": str(kept),
        "traced_step_ms": step / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "kernel_ms_by_kind": {kind: us / 1e3 for kind, us in kinds.items()},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    env = child_env()
    rows = plan(
        args.device,
        args.tiny,
        args.cut_layers,
        args.steps,
        args.kinds,
        shlex.split(args.tests) if args.tests is not None else None,
        moe_batch=args.moe_batch,
    )
    if args.only:
        rows = [r for r in rows if any(part in r.name for part in args.only.split(","))]
    started = time.perf_counter()
    # the orchestrator holds no CUDA context: the peak is measured in a process of its own
    n, dtype = (8192, "bfloat16") if args.device == "cuda" else (512, "float32")
    p = subprocess.run(
        [sys.executable, "-c", PEAK_CODE, args.device, str(n), dtype],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        print(
            f"gpu_suite: cannot use device {args.device}: {last}"
            + (
                "; without a GPU run the dry run, --device cpu --tiny"
                if args.device == "cuda"
                else ""
            ),
            file=sys.stderr,
        )
        return 2
    info = json.loads(p.stdout.strip().splitlines()[-1])
    needed = {k: v for k, v in info["missing"].items() if k != "torchao"}
    if needed:  # no titan row could run: say so before spending device time
        print(
            f"gpu_suite: titan's data stack does not import: {needed}; run "
            "scripts/gpu_wheels.sh here and carry .whl (see --help)",
            file=sys.stderr,
        )
        return 2
    if "torchao" in info["missing"]:
        print(f"gpu_suite: float8 rows will fail: {info['missing']['torchao']}", flush=True)
    from titan.components.data.tokenizer import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    ctx = {
        "args": args,
        "env": env,
        "work": work,
        "done": [],
        "vocab": Tokenizer(str(REPO_ROOT / "assets/tokenizer/tokenizer.json")).vocab_size,
        "peaks": {"datasheet": info["datasheet_flops"], "matmul": info["matmul_flops"]},
        "peer_version": None,
        "peer_status": "",
    }
    if "peer" in args.kinds:
        ctx["peer_version"], ctx["peer_status"] = peer_side.probe(env)
        if not ctx["peer_status"]:
            ctx["peer_inputs"] = peer_inputs(work)
    print(
        f"gpu_suite: {info['device_name']}, torch {info['torch']}, torchtitan "
        f"{ctx['peer_version'] or ctx['peer_status']}; {dtype} {n}^3 matmul "
        f"{_flops(info['matmul_flops'])}, datasheet {_flops(info['datasheet_flops'])}; "
        f"{len(rows)} rows",
        flush=True,
    )
    deadline = started + args.budget if args.budget else float("inf")
    for row in rows:
        left = deadline - time.perf_counter()
        if left < 30:  # no row does anything useful in less
            res = {**row.as_dict(), "status": "skipped: over the suite's --budget", "wall_s": 0.0}
        else:
            try:
                res = run_row(row, ctx, min(args.timeout, left))
            except Exception as e:  # noqa: BLE001  one row's surprise must not lose the others
                res = {**row.as_dict(), "status": f"failed: {type(e).__name__}: {e}", "wall_s": 0}
        ctx["done"].append(res)
        print(
            f"  {row.kind:<10} {row.name:<40} {res['status'][:70]:<20} {res['wall_s']:6.1f} s",
            flush=True,
        )
        if res.get("kernel_ms_by_kind"):
            kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in res["kernel_ms_by_kind"].items())
            print(
                f"    traced step {res['traced_step_ms']:.1f} ms, GPU busy "
                f"{res['gpu_busy_ms']:.1f} ms; kernels (ms): {kinds}",
                flush=True,
            )
        # written after every row: a lease that ends early still leaves the figures so far
        write_out(args.out, info, args, ctx, started)
    results = ctx["done"]
    meta = write_out(args.out, info, args, ctx, started)
    print(
        f"\n{info['device_name']}, torch {info['torch']}, {meta['date']}, "
        f"{meta['wall_s']:.0f} s\n\n{report.table(results)}"
    )
    print(f"\nwritten: {args.out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["status"].startswith("failed") for r in results) else 0


def write_out(out: Path, info: dict, args, ctx: dict, started: float) -> dict:
    """The figures so far (with their ratios and checks) as JSON; returns the meta block."""
    results = ctx["done"]
    report.compare(results)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **info,
        "tiny": args.tiny,
        "device": args.device,
        "torchtitan": ctx["peer_version"],
        "torchtitan_status": ctx["peer_status"] or "ok",
        "vocab_size": ctx["vocab"],
        "wall_s": time.perf_counter() - started,
        "work_dir": str(ctx["work"]) if args.keep else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    return meta


def _flops(v) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1e12:.0f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.1f} GFLOP/s"


if __name__ == "__main__":
    sys.exit(main())
