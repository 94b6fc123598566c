"""titan vs torchtitan, side by side: tokens/s, peak memory and start-up on the same work.

    python benchmarks/vs_torchtitan.py [--rounds 3 --steps 40 --layouts 1,fsdp2,tp2]
    python benchmarks/vs_torchtitan.py --family qwen3_moe [--layouts 1,fsdp2,ep2]
    python benchmarks/vs_torchtitan.py --family deepseek_v3

One command on a fresh machine: it installs torchtitan (pinned, `--torchtitan`) into its own
venv under `--scratch`, sharing this interpreter's installed torch (the same wheel, nothing
downloaded twice), and runs it through benchmarks/torchtitan_cpu_shim.py, which adapts it to a
CPU/gloo machine at import time. Both train titan's flavor (torchtitan gets it as the flavor
`titan_shape`), on titan's bundled corpus and tokenizer, fp32, fused AdamW, no compile, no AC,
TensorBoard off, with the same threads per rank. Runs alternate titan/torchtitan (and swap
who goes first each round) so machine drift hits both alike.

MoE families (`--family qwen3_moe|deepseek_v3`): the same experts, top-k, shared experts,
dense first layers and routing function on both sides (Qwen3-MoE's debug shape with every
layer routed, as torchtitan's Qwen3 has it: benchmarks/moe_flavors.py registers it in titan;
DeepSeek-V3's debug model as titan ships it), no balancing loss, DeepSeek's routing-bias
update at 1e-3 on both. torchtitan's experts run its fp32 per-expert loop (its grouped GEMM
casts to bfloat16 and, for DeepSeek, wants an SM90 GPU); titan's run torch's fp32 grouped
GEMM.

tokens/s is each trainer's own figure, per device, over the log windows after `--warmup`
steps (both count tokens / (window seconds x non-data-parallel degree)). Peak RSS is the
largest process of the job; start-up is launch to the end of step 1. "other load" is the CPU
the rest of the machine used during the run, in cores: a noisy run shows there.
Offline: `--wheelhouse DIR` installs torchtitan and its extra dependencies from wheels there.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from titan.tools.loss_compare import command, read_metrics  # noqa: E402

# run a command, then print its descendants' peak RSS and CPU seconds (this wrapper is their
# only ancestor that waits for them, so RUSAGE_CHILDREN covers exactly this job)
_MEASURED = """
import json, resource, subprocess, sys
code = subprocess.call(sys.argv[1:])
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print("BENCH_RUSAGE " + json.dumps({"maxrss_kib": r.ru_maxrss, "cpu_s": r.ru_utime + r.ru_stime,
                                    "code": code}), flush=True)
"""
STEP1 = re.compile(r"step:\s+1[\s/]")
TT_LOG = re.compile(r"step:\s*(\d+)\s.*tps:\s*([\d,]+)")
LAYOUTS = {
    "1": (1, {}),
    "fsdp2": (2, {"data_parallel_shard_degree": 2}),
    "tp2": (2, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}),
    "ep2": (2, {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}),
}
# --family -> (titan model name, titan flavor, titan flags, torchtitan model name)
FAMILIES = {
    "llama3": ("llama3", None, [], "llama3"),
    "qwen3_moe": (
        "qwen3",
        "debugmodel_moe_all",
        ["--job.custom_import", "benchmarks/moe_flavors.py", "--qwen3.moe_aux_loss_coeff", "0"],
        "qwen3",
    ),
    "deepseek_v3": (
        "deepseek_v3",
        "debugmodel",
        ["--deepseek_v3.moe_aux_loss_coeff", "0", "--deepseek_v3.moe_bias_update_rate", "0.001"],
        "deepseek_v3",
    ),
}


def busy_jiffies() -> int:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return user + nice + system + irq + softirq + steal


def measured_run(cmd: list[str], env: dict, log: Path, timeout: float) -> dict:
    """Run `cmd`; wall time, time to step 1, peak RSS, and the CPU the rest of the machine used."""
    hz = os.sysconf("SC_CLK_TCK")
    t0, busy0 = time.perf_counter(), busy_jiffies()
    first_step = None
    usage = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _MEASURED, *cmd],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        # a silent hang prints nothing: the timer kills the whole job, which ends the loop
        killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        killer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                if first_step is None and STEP1.search(line):
                    first_step = time.perf_counter() - t0
                if line.startswith("BENCH_RUSAGE "):
                    usage = json.loads(line.split(" ", 1)[1])
            proc.wait()
        finally:
            killer.cancel()
    if time.perf_counter() - t0 >= timeout:
        raise SystemExit(f"timed out after {timeout}s: {' '.join(cmd)} (log {log})")
    wall = time.perf_counter() - t0
    if usage.get("code") != 0:
        raise SystemExit(f"failed (exit {usage.get('code')}): {' '.join(cmd)}; see {log}")
    busy_s = (busy_jiffies() - busy0) / hz
    return {
        "wall_s": wall,
        "startup_s": first_step,
        "peak_rss_gib": usage["maxrss_kib"] / 2**20,
        "other_load_cores": max(0.0, busy_s - usage["cpu_s"]) / wall,
    }


# ---------------------------------------------------------------------------- torchtitan side


def torchtitan_python(scratch: Path, version: str, wheelhouse: str | None) -> Path:
    """A venv holding torchtitan==version on top of this interpreter's packages."""
    venv = scratch / f"venv-torchtitan-{version}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m; print(m.version('torchtitan'))"]
    if (
        python.exists()
        and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == version
    ):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    import site

    site_dir = next(venv.glob("lib/python*/site-packages"))
    # this interpreter's packages (torch among them) are seen, not reinstalled
    (site_dir / "titan_bench_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    constraints = scratch / "constraints.txt"
    # pinned to what is installed, so pip never swaps torch for another build
    constraints.write_text(
        "".join(line + "\n" for line in freeze.splitlines() if "==" in line and " @ " not in line)
    )
    cmd = [
        str(python),
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        str(constraints),
        f"torchtitan=={version}",
    ]
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    print(f"installing torchtitan {version} into {venv}", flush=True)
    subprocess.run(cmd, check=True)
    subprocess.run(probe, check=True, capture_output=True)
    return python


def torchtitan_shape(family: str, flavor: str) -> dict:
    """titan's flavor as torchtitan's model-args fields (`moe_args`: MoEArgs fields)."""
    if family == "qwen3_moe":
        return _qwen3_moe_shape(flavor)
    if family == "deepseek_v3":
        return _deepseek_v3_shape(flavor)
    from titan.models.llama3.args import LLAMA3_FLAVORS

    a = LLAMA3_FLAVORS[flavor]
    if a.tie_word_embeddings:
        raise SystemExit(f"flavor {flavor} ties its embeddings; torchtitan's llama3 cannot")
    return dict(
        dim=a.dim,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        multiple_of=a.multiple_of,
        ffn_dim_multiplier=a.ffn_dim_multiplier,
        norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
    )


def _moe_args(m, **extra) -> dict:
    # scores multiply the experts' outputs (titan's order); fp32 per-expert loop (see above)
    return dict(
        num_experts=m.n_experts,
        num_shared_experts=m.n_shared_experts,
        top_k=m.top_k,
        score_func=m.score_func,
        route_norm=m.norm_topk_prob,
        route_scale=m.route_scale,
        score_before_experts=False,
        use_grouped_mm=False,
        **extra,
    )


def _qwen3_moe_shape(flavor: str) -> dict:
    import benchmarks.moe_flavors  # noqa: F401  (registers the all-routed shape)
    from titan.models.qwen3.args import QWEN3_FLAVORS

    a = QWEN3_FLAVORS[flavor]
    if a.mlp_only_layers or a.moe is None or a.moe.n_groups > 1:
        raise SystemExit(f"qwen3 flavor {flavor}: torchtitan's Qwen3 routes every layer")
    return dict(
        dim=a.dim,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab_size,
        hidden_dim=a.ffn_hidden_dim,
        norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        qk_norm=True,
        enable_weight_tying=a.tie_word_embeddings,
        moe_enabled=True,
        moe_inter_dim=a.moe.hidden_dim,
        moe_args=_moe_args(a.moe, load_balance_coeff=None),
    )


def _deepseek_v3_shape(flavor: str) -> dict:
    from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS

    a = DEEPSEEK_V3_FLAVORS[flavor]
    if a.tie_word_embeddings or a.mtp_depth or a.rope_scaling_factor:
        raise SystemExit(f"deepseek_v3 flavor {flavor}: tied, MTP or YaRN (not benchmarked)")
    m = a.moe
    groups = dict(num_expert_groups=m.n_groups, num_limited_groups=m.topk_groups)
    return dict(
        dim=a.dim,
        n_layers=a.n_layers,
        n_dense_layers=a.n_dense_layers,
        n_heads=a.n_heads,
        vocab_size=a.vocab_size,
        inter_dim=a.ffn_hidden_dim,
        moe_inter_dim=m.hidden_dim,
        norm_eps=a.norm_eps,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        rope_theta=a.rope_theta,
        moe_args=_moe_args(
            m,
            load_balance_coeff=1e-3 if m.score_bias else None,
            **(groups if m.n_groups > 1 else {}),
        ),
    )


def torchtitan_assets(scratch: Path, tokenizer: Path) -> Path:
    """titan's tokenizer as an HF assets folder: tokenizer.json plus its BOS/EOS names."""
    from titan.components.data.tokenizer import Tokenizer

    folder = scratch / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    tok = Tokenizer(str(tokenizer))
    name = tok._tok.id_to_token
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": name(tok.bos_id),
                "eos_token": name(tok.eos_id),
                "add_bos_token": True,
                "add_eos_token": True,
            }
        )
    )
    return folder


def torchtitan_toml(args, dump: Path, assets: Path, par: dict) -> str:
    lines = [
        "[job]",
        f'dump_folder = "{dump}"',
        "[model]",
        f'name = "{FAMILIES[args.family][3]}"',
        'flavor = "titan_shape"',
        f'hf_assets_path = "{assets}"',
        "[optimizer]",
        'name = "AdamW"',
        f"lr = {args.lr}",
        "weight_decay = 0.1",
        'implementation = "fused"',
        "[lr_scheduler]",
        "warmup_steps = 5",
        "[training]",
        'dataset = "titan_corpus"',
        f"local_batch_size = {args.batch}",
        f"seq_len = {args.seq_len}",
        f"steps = {args.steps}",
        "max_norm = 1.0",
        'mixed_precision_param = "float32"',
        "gc_freq = 50",
        "[metrics]",
        f"log_freq = {args.warmup}",
        "enable_tensorboard = false",
        "disable_color_printing = true",
        "[activation_checkpoint]",
        'mode = "none"',
        "[parallelism]",
        *(f"{k} = {v}" for k, v in par.items()),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the two runs


def threads(nproc: int) -> dict:
    """The same threads per rank on both sides (run_train.sh would set this for titan alone)."""
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}


def profiling_flags(args) -> list[str]:
    # the same flags on both sides: one traced step every --warmup steps, per rank
    return (
        [
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            str(args.warmup),
            "--profiling.profiler_active",
            "1",
        ]
        if args.profile
        else []
    )


def run_titan(args, layout: str, out: Path) -> dict:
    nproc, par = LAYOUTS[layout]
    dump = out / f"titan-{layout}"
    name, _, family_flags, _ = FAMILIES[args.family]
    cmd, env = command(
        nproc,
        [
            *family_flags,
            "--model.name",
            name,
            "--model.flavor",
            args.flavor,
            "--training.steps",
            str(args.steps),
            "--training.seq_len",
            str(args.seq_len),
            "--training.local_batch_size",
            str(args.batch),
            "--training.gc_freq",
            "50",
            "--training.mixed_precision_param",
            "float32",
            "--optimizer.lr",
            str(args.lr),
            "--optimizer.implementation",
            "fused",
            "--metrics.log_freq",
            str(args.warmup),
            "--metrics.enable_tensorboard",
            "false",
            *profiling_flags(args),
            *(x for k, v in par.items() for x in (f"--parallelism.{k}", str(v))),
        ],
        dump,
        env=threads(nproc),
    )
    r = measured_run(cmd, env, out / f"titan-{layout}.log", args.timeout)
    r["tps"] = statistics.fmean(
        x["tps"]
        for x in read_metrics(dump)
        if "tps" in x and x["step"] > args.warmup and x["step"] % args.warmup == 0
    )
    return r


def run_torchtitan(args, layout: str, out: Path, python: Path, assets: Path) -> dict:
    nproc, par = LAYOUTS[layout]
    toml = out / f"torchtitan-{layout}.toml"
    toml.write_text(torchtitan_toml(args, out / f"torchtitan-{layout}", assets, par))
    cmd = [
        str(python),
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--local-ranks-filter=0",
        str(REPO / "benchmarks" / "torchtitan_cpu_shim.py"),
        "--job.config_file",
        str(toml),
        *profiling_flags(args),
    ]
    env = {
        **os.environ,
        **threads(nproc),
        "TITAN_BENCH_FAMILY": FAMILIES[args.family][3],
        "TITAN_BENCH_SHAPE": json.dumps(torchtitan_shape(args.family, args.flavor)),
        "TITAN_BENCH_CORPUS": str(REPO / "assets/corpus/kjv_train.jsonl"),
    }
    log = out / f"torchtitan-{layout}.log"
    r = measured_run(cmd, env, log, args.timeout)
    windows = [
        float(t.replace(",", ""))
        for s, t in TT_LOG.findall(log.read_text())
        if int(s) > args.warmup and int(s) % args.warmup == 0
    ]
    r["tps"] = statistics.fmean(windows)
    return r


# ---------------------------------------------------------------------------- report


def rounds(runs: list[dict]) -> str:
    return " / ".join(f"{r['tps']:,.0f}" for r in runs)


def report(rows: dict, device: str) -> str:
    out = [
        f"device: {device}",
        "| layout | titan tok/s (rounds) | torchtitan tok/s (rounds) | ratio of means | "
        "peak RSS GiB titan / tt | start-up s titan / tt | other load, cores (max) |",
        "|---|---|---|---:|---|---|---:|",
    ]
    for layout, runs in rows.items():
        ti, tt = runs["titan"], runs["torchtitan"]
        mean = {k: statistics.fmean(r["tps"] for r in v) for k, v in runs.items()}
        out.append(
            f"| {layout} | {rounds(ti)} | {rounds(tt)} | "
            f"**{mean['titan'] / mean['torchtitan']:.3f}** | "
            f"{max(r['peak_rss_gib'] for r in ti):.2f} / "
            f"{max(r['peak_rss_gib'] for r in tt):.2f} | "
            f"{statistics.fmean(r['startup_s'] for r in ti):.1f} / "
            f"{statistics.fmean(r['startup_s'] for r in tt):.1f} | "
            f"{max(r['other_load_cores'] for r in ti + tt):.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out; also the log window")
    ap.add_argument("--family", default="llama3", choices=list(FAMILIES))
    ap.add_argument(
        "--layouts",
        default=None,
        help=f"from {', '.join(LAYOUTS)} (default: 1,fsdp2,tp2; MoE: 1,fsdp2,ep2)",
    )
    ap.add_argument(
        "--flavor", default=None, help="a titan flavor of the family (default: its debug shape)"
    )
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--torchtitan", default="0.2.2", help="torchtitan version to install")
    ap.add_argument("--scratch", default=str(REPO / "benchmarks" / ".scratch" / "vs_torchtitan"))
    ap.add_argument("--wheelhouse", default=None, help="install torchtitan offline from here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch profiler traces of both sides under <scratch>/roundN/ (tok/s of a "
        "profiled run are not comparable)",
    )
    ap.add_argument("--json", default=None, help="also write every run's figures here")
    args = ap.parse_args()
    moe = args.family != "llama3"
    args.flavor = args.flavor or FAMILIES[args.family][1] or "debugmodel"
    layouts = (args.layouts or ("1,fsdp2,ep2" if moe else "1,fsdp2,tp2")).split(",")
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    if args.steps < 2 * args.warmup:
        ap.error("--steps must be at least twice --warmup (one measured window or more)")

    import torch

    device = (
        f"cuda ({torch.cuda.get_device_name()})"
        if torch.cuda.is_available()
        else f"cpu ({os.cpu_count()} cores)"
    ) + f", torch {torch.__version__}"
    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():  # one process per GPU: a layout needs that many
        fits = [x for x in layouts if LAYOUTS[x][0] <= torch.cuda.device_count()]
        for x in sorted(set(layouts) - set(fits)):
            print(
                f"skipping {x}: it needs {LAYOUTS[x][0]} GPUs, this machine has "
                f"{torch.cuda.device_count()}"
            )
        layouts = fits
    python = torchtitan_python(scratch, args.torchtitan, args.wheelhouse)
    assets = torchtitan_assets(scratch, REPO / "assets/tokenizer/tokenizer.json")
    rows = {x: {"titan": [], "torchtitan": []} for x in layouts}
    for r in range(args.rounds):
        out = scratch / f"round{r + 1}"
        out.mkdir(exist_ok=True)
        for layout in layouts:
            order = ["titan", "torchtitan"][:: 1 if r % 2 == 0 else -1]
            for who in order:
                res = (
                    run_titan(args, layout, out)
                    if who == "titan"
                    else run_torchtitan(args, layout, out, python, assets)
                )
                rows[layout][who].append(res)
                print(
                    f"round {r + 1} {layout:>5} {who:>10}: {res['tps']:8,.0f} tok/s  "
                    f"peak RSS {res['peak_rss_gib']:.2f} GiB  start-up {res['startup_s']:.1f} s"
                    f"  other load {res['other_load_cores']:.2f} cores",
                    flush=True,
                )
    print()
    print(report(rows, device))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device, "args": vars(args), "runs": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
