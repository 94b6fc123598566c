"""Observing a run: Weights & Biases (offline), the plot tool, and the checks of the
CUDA-only parts (memory snapshots, the NCCL flight recorder) on CPU."""

import json
import os
import sys

import pytest

from titan.config import ConfigError, parse_args

DEBUG = ["--model.flavor", "debugmodel"]


# ------------------------------------------------------------------------ Weights & Biases


def wandb_records(path):
    """The records of a W&B run file (`run-<id>.wandb`: a 7-byte header, then LevelDB-log
    blocks of 32 KiB, each record split into chunks with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
        elif kind == 0:
            pending = b""
    return out


def wandb_history(run_dir) -> tuple[dict[int, dict], dict]:
    """({step: {key: value}}, the run's config) from an offline run folder."""
    (path,) = run_dir.glob("run-*.wandb")
    history, config = {}, {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            history.setdefault(int(items["_step"]), {}).update(items)
        elif kind in ("run", "config"):
            update = r.run.config.update if kind == "run" else r.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    return history, config


@pytest.mark.needs("wandb")
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_wandb_offline_run_holds_the_logged_values_and_resume_continues_it(
    tmp_path, monkeypatch, capfd
):
    from tests.forked import run_trainer, tiny_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    argv = [
        *DEBUG,
        *tiny_run(4),
        "--metrics.enable_wandb",
        "--metrics.wandb_tags",
        "ci,cpu",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    first = run_trainer(tmp_path, 1, [*argv, "--training.exit_at_step", "2"])
    # W&B's own output (banner, sync hints, summary tables) is off: titan's run line says it
    out = capfd.readouterr()
    console = out.out + out.err + (tmp_path / "rank0.log").read_text()
    assert "wandb:" not in console and "titan" in console, console
    second = run_trainer(tmp_path, 1, argv)  # resumes the step-2 checkpoint
    # metrics.jsonl: the whole history, the resumed run's steps appended to the first's
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in second] == [1, 2, 3, 4]
    dump = tmp_path / "dump"
    run_id = (dump / "wandb_run_id").read_text().strip()
    runs = sorted((dump / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # one folder per launch, one run id: W&B joins them on sync
    records = second
    for run_dir, steps in zip(runs, ([1, 2], [3, 4])):
        history, config = wandb_history(run_dir)
        assert sorted(history) == steps
        for r in records[steps[0] - 1 : steps[-1]]:
            logged = history[r["step"]]
            for key in ("loss", "grad_norm", "lr", "tps", "memory_gib", "data_pct"):
                assert logged[f"train/{key}"] == pytest.approx(r[key], rel=1e-12), key
        # the merged config, as TOML and CLI made it
        assert config["training"]["steps"] == 4 and config["model"]["flavor"] == "debugmodel"
        assert config["metrics"]["wandb_tags"] == ["ci", "cpu"]


def test_wandb_missing_is_named_before_launch(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    from titan.plan.run_plan import plan_run

    with pytest.raises(ConfigError, match=r"needs the wandb package: pip install 'titan\[wandb\]'"):
        plan_run(parse_args([*DEBUG, "--metrics.enable_wandb"]), 1)


# ------------------------------------------------------------------------------ the plot tool


def fake_run(folder, losses, validation=()):
    folder.mkdir(parents=True)
    rows = [
        {
            "step": i + 1,
            "loss": loss,
            "grad_norm": 1.0 / (i + 1),
            "lr": 1e-3 * (i + 1),
            "tps": 1000.0 + i,
            "mfu": None,
            "memory_gib": 0.5,
        }
        for i, loss in enumerate(losses)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if validation:
        (folder / "validation.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "val_loss": v, "val_batches": 2}) + "\n"
                for s, v in validation
            )
        )


@pytest.mark.needs("matplotlib")
def test_plot_draws_each_run_on_every_panel(tmp_path):
    from matplotlib.image import imread

    from titan.tools import plot

    fake_run(tmp_path / "compare" / "baseline", [5.0, 4.0, 3.0], validation=[(3, 3.5)])
    fake_run(tmp_path / "compare" / "candidate0", [5.0, 4.1, 3.1])
    fake_run(tmp_path / "solo", [6.0, 5.5])
    runs = plot.find_runs([str(tmp_path / "compare"), str(tmp_path / "solo")])
    assert list(runs) == ["baseline", "candidate0", "solo"]  # a loss-compare --out expands
    out = tmp_path / "runs.png"
    fig = plot.plot_runs(runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(out).shape[:2] == (800, 1500)
    panels = {ax.get_title(): ax for ax in fig.axes}
    loss = panels["loss"]
    assert [ln.get_label() for ln in loss.get_lines()] == [
        "baseline",
        "baseline (validation)",
        "candidate0",
        "solo",
    ]
    assert list(loss.get_lines()[2].get_ydata()) == [5.0, 4.1, 3.1]
    assert list(loss.get_lines()[1].get_xdata()) == [3]
    for title in ("grad norm", "learning rate", "tokens/s (per device)", "peak memory GiB"):
        assert len(panels[title].get_lines()) == 3, title
    assert not panels["MFU %"].get_lines()  # CPU runs log no MFU: the panel says so
    assert "no mfu logged" in panels["MFU %"].texts[0].get_text()


@pytest.mark.needs("matplotlib")
def test_plot_draws_a_panel_for_each_downstream_score(tmp_path):
    from titan.tools import plot

    fake_run(tmp_path / "a", [5.0, 4.0, 3.0, 2.5])
    scores = [{"step": 2, "cloze/acc": 0.25, "seconds": 3.0}, {"step": 4, "cloze/acc": 0.5}]
    (tmp_path / "a" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in scores))
    fig = plot.plot_runs(plot.find_runs([str(tmp_path / "a")]), tmp_path / "runs.png")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert len(panels) == 7 and "eval: seconds" not in panels
    (line,) = panels["eval: cloze/acc"].get_lines()
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.25, 0.5]


@pytest.mark.needs("matplotlib")
def test_plot_cli_names_a_folder_without_metrics(tmp_path, capsys):
    from titan.tools import plot

    assert plot.main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl in it or in its subfolders" in capsys.readouterr().err
    fake_run(tmp_path / "run", [2.0, 1.0])
    assert plot.main([str(tmp_path / "run"), "-o", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").stat().st_size > 0
    capsys.readouterr()

    def one_line_error(*argv) -> str:
        assert plot.main([*argv]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1, out.err
        return out.err

    # a run killed mid-write leaves its last line cut short: the lines before it are drawn
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "lo')
    assert plot.main([str(tmp_path / "run"), "-o", str(tmp_path / "y.png")]) == 0
    assert "1 run drawn" in capsys.readouterr().out
    assert "cannot write " in one_line_error(str(tmp_path / "run"), "-o", str(metrics / "x.png"))
    metrics.write_text('{"step": 1, "lo\n{"step": 2}\n')  # damaged mid-file
    assert "metrics.jsonl, line 1: not a JSON record" in one_line_error(str(tmp_path / "run"))
    metrics.write_text("")  # started, nothing logged yet
    assert "holds no logged step yet" in one_line_error(str(tmp_path / "run"))


# ------------------------------------------------------------------ CUDA-only parts on CPU


def test_memory_snapshot_needs_cuda_and_says_so():
    from titan.plan.run_plan import plan_run

    job = parse_args([*DEBUG, "--training.device", "cpu", "--profiling.enable_memory_snapshot"])
    with pytest.raises(
        ConfigError,
        match=r"profiling.enable_memory_snapshot = True .*: records "
        r"the CUDA caching allocator's history: it needs a GPU",
    ):
        plan_run(job, 1)


def test_flight_recorder_settings(tmp_path, monkeypatch):
    from titan.components.observability import flight_recorder
    from titan.plan.run_plan import plan_run

    job = parse_args([*DEBUG, "--comm.trace_buf_size", "500", "--job.dump_folder", str(tmp_path)])
    plan_run(job, 1)  # accepted on CPU
    env = flight_recorder.flight_recorder_env(job.comm, str(tmp_path))
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path.resolve() / "comm_traces" / "rank_")
    for key in env:
        monkeypatch.delenv(key, raising=False)
    flight_recorder.configure_flight_recorder(job.comm, str(tmp_path), "cpu")
    assert not any(k in os.environ for k in env)  # gloo keeps no record
    flight_recorder.configure_flight_recorder(job.comm, str(tmp_path), "cuda")
    assert (tmp_path / "comm_traces").is_dir()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500"
    off = parse_args([*DEBUG, "--comm.trace_buf_size", "0"])
    assert flight_recorder.flight_recorder_env(off.comm, str(tmp_path)) == {}
    with pytest.raises(ConfigError, match=r"comm.trace_buf_size = -1"):
        plan_run(parse_args([*DEBUG, "--comm.trace_buf_size", "-1"]), 1)


# ------------------------------------------------------------- the same on a GPU (gpu_suite)


def _cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_memory_snapshot_dumps_every_profile_freq_steps_and_on_oom(tmp_path):
    import pickle
    import subprocess

    import torch

    from titan.components.observability.memory_snapshot import MemorySnapshot
    from titan.runtime.paths import REPO_ROOT

    _cuda()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan.trainer",
            *DEBUG,
            "--training.device",
            "cuda",
            "--training.steps",
            "4",
            "--training.seq_len",
            "64",
            "--profiling.enable_memory_snapshot",
            "--profiling.profile_freq",
            "2",
            "--profiling.memory_snapshot_start_step",
            "2",
            "--metrics.no_enable_tensorboard",
            "--job.dump_folder",
            str(tmp_path / "run"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "run" / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == ["iteration_2", "iteration_4"]
    snapshot = pickle.loads((folder / "iteration_4" / "rank0_memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # allocations with history
    # an out-of-memory step is dumped before the error goes on
    cfg = parse_args([*DEBUG, "--profiling.enable_memory_snapshot"]).profiling
    snap = MemorySnapshot(cfg, dump_folder=str(tmp_path / "oom"), rank=0)
    with pytest.raises(torch.OutOfMemoryError), snap.step(7):
        torch.empty(2**50, device="cuda")
    snap.close()
    assert (
        tmp_path / "oom" / "memory_snapshot" / "iteration_7_exit" / "rank0_memory_snapshot.pickle"
    ).stat().st_size > 0


@pytest.mark.gpu
def test_flight_recorder_keeps_the_nccl_collectives(tmp_path):
    import pickle
    import subprocess

    from titan.runtime.paths import REPO_ROOT

    _cuda()
    code = f"""
import os, pickle, sys, torch, torch.distributed as dist
from titan.config import parse_args
from titan.components.observability.flight_recorder import configure_flight_recorder
job = parse_args(["--comm.trace_buf_size", "64", "--job.dump_folder", {str(tmp_path)!r}])
configure_flight_recorder(job.comm, job.job.dump_folder, "cuda")
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
torch.cuda.set_device(0)
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
sys.stdout.buffer.write(torch._C._distributed_c10d._dump_nccl_trace())
dist.destroy_process_group()
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=300, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = pickle.loads(proc.stdout)["entries"]
    # "nccl:all_reduce" (older torch wrote "allreduce")
    reduces = [e for e in entries if "reduce" in e["profiling_name"]]
    assert len(reduces) == 3, entries


# ------------------------------------------------------------------- per-rank step times


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_a_slowed_rank_is_named_as_the_straggler(tmp_path):
    """FSDP 2, rank 1 sleeping 0.4 s in every step from step 2 (the fault-injection hook):
    both ranks' wall steps are equal, but rank 0 spends that time waiting for rank 1, so
    rank 1's own step time is the slowest; after 3 such log steps one warning names it."""
    import logging
    import socket

    from tests import workers
    from tests.forked import run_trainer, tiny_run
    from titan.components.observability import rank_times

    workers.hold(workers.ALL)  # its figures are step times: alone on the cores
    argv = [
        *DEBUG,
        *tiny_run(6),
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--debug.sleep_at_step",
        "2",
        "--debug.sleep_rank",
        "1",
        "--debug.sleep_seconds",
        "0.4",
        "--debug.sleep_every_step",
    ]
    log = logging.getLogger(rank_times.__name__)
    handler = logging.FileHandler(tmp_path / "warnings.log")  # the forked ranks write to it
    log.addHandler(handler)
    try:
        records = run_trainer(tmp_path, 2, argv)
    finally:
        log.removeHandler(handler)
    warnings = (tmp_path / "warnings.log").read_text().splitlines()
    slowed = records[1:]
    assert all(r["slowest_rank"] == 1 for r in slowed), slowed
    for r in slowed:
        assert r["slowest_rank_step_time_s"] >= 0.4, r
        # rank 0 computed what rank 1 did, less the sleep: the spread is the sleep
        assert r["rank_step_time_spread_s"] == pytest.approx(0.4, abs=0.15), r
        assert r["step_time_s"] >= 0.4  # everyone's wall step holds the sleep
    assert [r.get("straggler") for r in records] == [
        None,
        None,
        None,
        {"rank": 1, "host": socket.gethostname()},
        None,
        None,
    ]
    assert len(warnings) == 1 and f"rank 1 on {socket.gethostname()}" in warnings[0], warnings
