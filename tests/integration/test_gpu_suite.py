"""The GPU suite's dry run, `benchmarks/gpu_suite.py --device cpu --tiny`: every row kind of
the one-command GPU suite runs on the CPU, and the figures it writes are sane.

torchtitan is no CI dependency: its rows hold numbers where it is importable (then they take
a minute or two more) and otherwise say, explicitly, that it is not installed.
"""

import json
import math
import subprocess
import sys

import pytest

from tests import workers
from titan.runtime.paths import REPO_ROOT

TRAIN_KEYS = {
    "tps",
    "steps_timed",
    "mfu_datasheet_pct",
    "mfu_matmul_pct",
    "peak_memory_gib",
    "loss_first",
    "loss_last",
    "flops_per_token",
    "tps_ratio",
    "mem_ratio",
    "checks",
}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def tiny_suite(out, *args, timeout) -> tuple[str, dict]:
    """`gpu_suite.py --device cpu --tiny --out out *args`: its stdout and the JSON it wrote."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--tiny", *args]
        + ["--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def dry_run(tmp_path, rows: str) -> dict:
    out = tmp_path / f"suite_{rows.replace(',', '_')}.json"
    stdout, data = tiny_suite(out, "--rows", rows, timeout=900)
    assert "| row | side | status |" in stdout  # the markdown table
    return data


@pytest.mark.slow("every row of the GPU suite: eleven training runs, two saves and a nested pytest")
@pytest.mark.needs("torchao")  # the float8 row
def test_dry_run_takes_every_path(tmp_path):
    data = dry_run(tmp_path, "train,peer,tests")
    # it compares a sync save's blocked time with an async one's: on an otherwise idle machine
    workers.hold(workers.ALL)
    data["rows"] += dry_run(tmp_path, "checkpoint")["rows"]
    meta, rows = data["meta"], data["rows"]
    assert meta["device"] == "cpu" and meta["tiny"] and meta["matmul_flops"] > 0
    assert meta["datasheet_flops"] is None  # CPUs publish no peak: that MFU column is n/a
    by_kind = {
        k: [r for r in rows if r["kind"] == k] for k in ("train", "peer", "checkpoint", "tests")
    }
    assert [len(v) for v in by_kind.values()] == [6, 6, 2, 1]
    # the MoE rows run first (a short lease's first question), and learn
    moes = [r for r in rows[:4] if r["kind"] == "train"]
    assert [r["model"] for r in moes] == ["deepseek_v3", "qwen3"]
    for moe in moes:
        assert moe["flops_per_token"] > 0 and moe["loss_last"] < moe["loss_first"], moe

    for r in by_kind["train"]:
        assert r["status"] == "ok", r
        assert TRAIN_KEYS <= r.keys(), r
        assert r["tps"] > 0 and r["steps_timed"] == r["steps"] - r["warmup"]
        assert finite(r["mfu_matmul_pct"]) and r["mfu_matmul_pct"] > 0
        assert r["mfu_datasheet_pct"] is None
        assert r["peak_memory_gib"] > 0
        assert finite(r["loss_first"]) and finite(r["loss_last"])
    assert any(r["compile"] for r in by_kind["train"])
    assert {r["ac"] for r in by_kind["train"]} == {"selective", "full"}
    # float8 (emulated) learns like the full-precision row of the same shape and AC
    f8 = next(r for r in by_kind["train"] if r["float8"])
    ref = next(
        r
        for r in by_kind["train"]
        if not r["float8"] and r["shape"] == f8["shape"] and r["ac"] == f8["ac"]
    )
    assert abs(f8["loss_last"] - ref["loss_last"]) < 0.02 * ref["loss_last"], (f8, ref)
    assert f8["loss_last"] < f8["loss_first"]

    for peer in by_kind["peer"]:
        # each peer row runs right after the titan row of its name (the same shape)
        train = rows[rows.index(peer) - 1]
        assert train["kind"] == "train" and peer["name"] == train["name"]
        assert peer["shape"] == train["shape"]
        if peer["status"] == "ok":  # torchtitan importable here
            assert peer["tps"] > 0 and peer["peak_memory_gib"] > 0
            assert finite(peer["mfu_matmul_pct"]) and finite(peer["loss_last"])
            assert peer["flops_per_token"] == train["flops_per_token"]  # the same shape
            assert train["tps_ratio"] > 0 and train["mem_ratio"] > 0
            assert set(train["checks"].values()) <= {"pass", "fail"}
        else:
            assert peer["status"] == (
                "not installed (run scripts/gpu_wheels.sh and carry .whl)"
            ) or peer["status"].startswith("not importable")
            assert train["tps_ratio"] is None and train["mem_ratio"] is None
            assert train["checks"] == {"tps>=1.05x": "n/a", "mem<=1x": "n/a"}

    sync, async_ = by_kind["checkpoint"]
    assert sync["checkpoint_mode"] == "disabled" and async_["checkpoint_mode"] == "async"
    assert sync["status"] == async_["status"] == "ok"
    assert not sync["ran_async"] and async_["ran_async"]
    assert 0 < async_["blocked_s"] < sync["blocked_s"], (sync, async_)
    assert finite(async_["pct_of_sync"]) and list(async_["checks"].values())[0] in ("pass", "fail")

    (tests,) = by_kind["tests"]
    assert tests["status"] == "ok" and tests["counts"].get("passed", 0) >= 1, tests


def test_budget_skips_what_it_cannot_start(tmp_path):
    """--budget: rows that would start past it are reported skipped, and the JSON is written."""
    args = ["--rows", "train,checkpoint", "--only", "SAC,save", "--budget", "1"]
    rows = tiny_suite(tmp_path / "suite.json", *args, timeout=300)[1]["rows"]
    # --only: the rows named SAC (not the full-AC one) and the saves
    assert sorted(r["kind"] for r in rows) == ["checkpoint"] * 2 + ["train"] * 5
    assert {r["status"] for r in rows} == {"skipped: over the suite's --budget"}


def test_profile_traces_a_step_past_the_timed_ones(tmp_path):
    """--profile: the row runs two steps more (the profiler's warm-up, then the traced one),
    keeps its trace gzipped beside the JSON and times the row's own steps only; --moe-batch
    sets the MoE rows' batch and their names say it."""
    import gzip

    out = tmp_path / "suite.json"
    args = ["--rows", "train", "--only", "DeepSeek", "--moe-batch", "3", "--profile"]
    stdout, data = tiny_suite(out, *args, timeout=300)
    (row,) = data["rows"]
    assert row["status"] == "ok" and row["batch"] == 3 and row["name"].endswith(" batch 3")
    assert row["steps_timed"] == row["steps"] - row["warmup"]
    with gzip.open(row["trace"], "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    # the profiler numbers steps from 0: the row's last (steps + 2) is #steps + 1
    assert f"ProfilerStep#{row['steps'] + 1}" in names, sorted(n for n in names if "Step" in n)
    assert row["trace"].startswith(str(tmp_path / "traces"))
    # a CPU trace holds no GPU kernels: the sums are empty, the host's time is still there
    assert row["kernel_ms_by_kind"] == {} and row["traced_step_ms"] > 0


def test_the_experts_benchmark_times_every_path(capsys):
    """benchmarks/moe_experts.py's dry run: the four ways the experts compute, each timed."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import moe_experts
    finally:
        sys.path.pop(0)
    assert moe_experts.main(["--device", "cpu", "--tiny", "--iters", "1"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| debug")]
    paths = [tuple(c.strip() for c in r.split("|")[2:4]) for r in rows]
    assert paths == [
        ("bf16 autocast", "grouped GEMM"),
        ("bf16 autocast", "per-expert loop"),
        ("fp32", "grouped GEMM"),
        ("fp32", "per-expert loop"),
    ]
    assert all(float(r.split("|")[4]) > 0 for r in rows)
