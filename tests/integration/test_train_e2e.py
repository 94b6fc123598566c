"""The real ./run_train.sh on one CPU rank: learning, logs, TensorBoard, errors."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests import workers
from tests.integration.harness import DEVICE, FAST
from titan.runtime.paths import REPO_ROOT

REQUIRED = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "gc_s"}


@pytest.mark.slow("30 steps through run_train.sh: learning, every log field and TensorBoard")
def test_debug_model_learns_and_logs(train_run):
    proc, records, dump = train_run(
        1,
        "--training.steps",
        "30",
        "--metrics.log_freq",
        "1",
        "--training.gc_freq",
        "10",
        timeout=400,
    )
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert REQUIRED <= r.keys(), r
        assert r["tps"] > 0 and r["tflops"] > 0 and r["memory_gib"] > 0
        # CPUs publish no peak FLOP/s: no MFU there unless metrics.peak_flops states one
        assert r["mfu"] is None if DEVICE == "cpu" else 0 < r["mfu"] <= 100
    first, last = records[0]["loss"], records[-1]["loss"]
    # uniform guessing over the 2048-token vocabulary is ln(2048) = 7.62
    assert 7.3 < first < 8.5
    assert last < first - 2.0, (first, last)
    assert records[9]["gc_s"] > 0 and records[8]["gc_s"] == 0  # gc every 10 steps, timed
    # warmup of 5 steps to lr 3e-3, then linear decay to 0.1x
    assert abs(records[0]["lr"] - 3e-3 / 5) < 1e-12
    assert abs(records[4]["lr"] - 3e-3) < 1e-12
    assert abs(records[-1]["lr"] - 3e-4) < 1e-9

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_dirs = [p.parent for p in (dump / "tb").rglob("events.out.tfevents*")]
    assert len(event_dirs) == 1
    acc = EventAccumulator(str(event_dirs[0]))
    acc.Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in tb_loss] == list(range(1, 31))
    assert abs(tb_loss[-1][1] - last) < 1e-5
    assert "loss:" in proc.stderr  # the human-readable line exists too
    # start-up gets comm.init_timeout_seconds; from the end of step 1, the training limit
    assert proc.stderr.index("collective timeout now 100s") < proc.stderr.index("step:  2/30")
    # progress: N/total and, from step 2 to the one before last, the time left
    lines = {int(m[1]): m[0] for m in re.finditer(r".*step: +(\d+)/30 .*", proc.stderr)}
    assert sorted(lines) == list(range(1, 31))
    assert re.search(r"  eta: (\d+m)?\d+s$", lines[2]) and re.search(r"eta: \d", lines[29])
    assert "eta" not in lines[1] and "eta" not in lines[30]
    assert "\033[" not in proc.stderr  # no color codes when not writing to a terminal


def test_config_error_exits_2_before_writing(tmp_path):
    dump = tmp_path / "never"
    proc = subprocess.run(
        [str(REPO_ROOT / "run_train.sh"), "--training.stepz", "3", "--job.dump_folder", str(dump)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "training.stepz" in proc.stderr and "did you mean 'training.steps'" in proc.stderr
    assert proc.stderr.count("config error") == 1
    assert not dump.exists()

    proc = subprocess.run(
        [str(REPO_ROOT / "run_train.sh"), "--training.steps", "-4", "--job.dump_folder", str(dump)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "training.steps = -4" in proc.stderr
    proc = subprocess.run(
        [str(REPO_ROOT / "run_train.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CONFIG_FILE": "missing.toml", "PATH": _path()},
    )
    assert (
        proc.returncode == 2 and "missing.toml" in proc.stderr and "does not exist" in proc.stderr
    )
    assert not dump.exists()


def _path():
    import os

    return os.environ["PATH"]


def test_help_lists_every_field():
    proc = subprocess.run(
        [str(REPO_ROOT / "run_train.sh"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for key in (
        "--training.steps",
        "--optimizer.lr",
        "--parallelism.tensor_parallel_degree",
        "--metrics.log_freq",
        "--comm.train_timeout_seconds",
    ):
        assert key in proc.stdout


@pytest.mark.parametrize("flag", ["--job.print_config", "--job.print_config=true"])
def test_print_config_shows_merged_values(train_run, flag):
    proc, records, _ = train_run(1, *FAST, "--training.steps", "1", flag, "--optimizer.lr=0.01")
    assert "lr = 0.01" in proc.stdout and "steps = 1" in proc.stdout
    assert len(records) == 1
    assert proc.stdout.count("[optimizer]") == 1  # by the launcher only, in either form


def test_profiler_traces_carry_rank(train_run):
    _, records, dump = train_run(
        1,
        *FAST,
        "--training.steps",
        "4",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "0",
    )
    traces = sorted(
        p.relative_to(dump / "profile_traces").as_posix()
        for p in (dump / "profile_traces").rglob("*.json")
    )
    assert traces == ["iteration_2/rank0_trace.json", "iteration_4/rank0_trace.json"]
    trace = json.loads((dump / "profile_traces" / traces[0]).read_text())
    assert trace["traceEvents"]
    assert len(records) == 4


def test_nonfinite_loss_stop_and_skip(train_run):
    proc, records, _ = train_run(
        1, *FAST, "--training.steps", "5", "--debug.nan_at_step", "3", check=False, name="stop"
    )
    assert proc.returncode != 0
    assert "at step 3" in proc.stdout + proc.stderr
    assert [r["step"] for r in records] == [1, 2]

    proc, records, _ = train_run(
        1,
        *FAST,
        "--training.steps",
        "5",
        "--debug.nan_at_step",
        "3",
        "--training.on_nonfinite",
        "skip",
        name="skip",
    )
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2].get("skipped_steps") == 1 and records[-1]["skipped_steps"] == 1
    assert all(r["loss"] == r["loss"] for i, r in enumerate(records) if i != 2)  # finite again


def test_a_spike_stops_a_launched_run_before_its_update(train_run):
    """stability.on_spike = stop: the run ends at the flagged step with one error line naming
    it (exit 1, not restarted: a restart would meet the same step), the spike recorded."""
    proc, records, dump = train_run(
        1,
        *FAST,
        "--training.steps",
        "10",
        "--stability.spike_window",
        "4",
        "--stability.on_spike",
        "stop",
        # at the debug config's 3e-3 the gradient norm more than doubles by itself by step 6
        "--optimizer.lr",
        "8e-4",
        "--debug.bad_batch_at_step",
        "8",
        check=False,
    )
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    errors = [ln for ln in out.splitlines() if "ERROR" in ln or "Traceback" in ln]
    assert len(errors) == 1 and "step 8: grad_norm spike" in errors[0], errors
    assert "stability.on_spike = stop" in errors[0] and "restart" not in out.lower(), out[-2000:]
    assert [r["step"] for r in records] == list(range(1, 8))
    (spike,) = [json.loads(x) for x in (dump / "spikes.jsonl").read_text().splitlines()]
    assert spike["step"] == 8 and spike["action"] == "stop" and spike["grad_norm_sigma"] > 50


def test_validation_and_plain_python_entry(tmp_path):
    """`python -m titan.trainer` works without torchrun and writes validation.jsonl."""
    dump = tmp_path / "plain"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan.trainer",
            "--job.config_file",
            "train_configs/debug_model.toml",
            *FAST,
            "--training.steps",
            "4",
            "--validation.enable",
            "--validation.freq",
            "2",
            "--validation.steps",
            "3",
            "--job.dump_folder",
            str(dump),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = [json.loads(x) for x in (dump / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in val] == [2, 4]
    assert all(v["val_batches"] == 3 for v in val)
    assert val[1]["val_loss"] < val[0]["val_loss"] < 8.5


@pytest.mark.slow("a 2-rank launch with async saves and a TP 2 generation")
def test_a_two_rank_async_run_and_tp_generation_print_titan_lines_only(tmp_path):
    """What a user reads: every line of a 2-rank run (both ranks shown) with async saves is
    titan's own, or its launcher's, and so is TP-2 generation's: no deprecated-variable
    warning from titan's settings, no mesh-pickling warning or INFO chatter from DCP's saving
    process, no unwaited collective at exit. A warning titan could not avoid would have to be
    named here with its reason."""
    from tests.integration.harness import launch

    # alone on the cores: a rank slowed by another test's would be named a straggler, in a
    # line of its own
    workers.hold(workers.ALL)
    dump = tmp_path / "run"
    proc = launch(
        2,
        [
            *FAST,
            "--training.steps",
            "10",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "3",
            "--checkpoint.async_mode",
            "async",
            # the straggler report has its own tests; here the host's hiccups (a 0.39 s step
            # against a 0.30 s median, seen once in five runs) would add a line of it
            "--metrics.straggler_threshold",
            "10",
        ],
        dump,
        env={"LOG_RANK": "0,1"},
        timeout=400,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    own = [
        ln
        for ln in lines
        if ln.startswith(("[rank0]:[titan rank0] ", "[rank1]:[titan rank1] ", "titan: "))
    ]
    assert own == lines, [ln for ln in lines if ln not in own]
    # per rank: model, MFU, job, training, timeout, 10 steps, 3 async saves x 2, the final
    # save, done
    assert len(lines) <= 2 * 23, len(lines)
    gen = _generate_on_two_ranks(dump)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.startswith("In the beginning")
    noise = [ln for ln in gen.stderr.splitlines() if not ln.startswith("[titan rank")]
    assert noise == [], noise


def _generate_on_two_ranks(dump):
    """python -m titan.tools.generate under torchrun on 2 ranks (TP 2) from the run's
    checkpoint."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "titan.tools.generate",
            "--checkpoint",
            str(dump / "checkpoint"),
            "--prompt",
            "In the beginning",
            "--max-new-tokens",
            "4",
            "--training.seq_len",
            "64",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
