"""Faults: a killed rank, a rank killed mid-checkpoint, a stuck rank, an unwritable folder,
and what a failed run reports."""

import os
import signal
import subprocess
import time

import pytest

from tests import workers
from tests.integration.harness import (
    COMMON,
    RunFailed,
    command,
    dp_batch,
    find_workers,
    kill_workers,
    launch,
    losses,
    train,
)

STEPS = 16
BASE = [*COMMON, "--training.steps", str(STEPS)]
CK = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted reference runs, by dp degree (forked on CPU: the launched runs the tests
    kill and resume match them bit for bit)."""
    refs = {}
    for n in (2, 4):
        dump = tmp_path_factory.mktemp(f"straight{n}") / "dump"
        train(n, [*BASE, *dp_batch(n)], dump, timeout=600)
        refs[n] = losses(dump)
    return refs


def killed_run(nproc: int, victim: int, dump, restarts: int):
    """A launch of `nproc` ranks whose rank `victim` is SIGKILLed past the step-4 checkpoint,
    with MAX_RESTARTS `restarts`: (its exit code, its stderr) once it ends."""
    workers.hold(nproc)
    env = {"MAX_RESTARTS": str(restarts)}
    cmd, env = command(nproc, [*BASE, *CK, *dp_batch(nproc)], dump, env=env)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while max(losses(dump), default=0) < 6:  # past the step-4 checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
            time.sleep(0.2)
        (pid,) = find_workers(dump, rank=victim)
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_workers(dump)
    return proc.returncode, err


@pytest.mark.slow("a launch, a killed rank and torchrun's restart of every rank")
@pytest.mark.parametrize("nproc,victim", [(2, 1), (4, 2)])
def test_sigkilled_rank_restarts_and_resumes_exactly(nproc, victim, straight, tmp_path):
    dump = tmp_path / "run"
    code, err = killed_run(nproc, victim, dump, restarts=2)
    assert code == 0, err[-3000:]
    assert "resumed from" in err
    got = losses(dump)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == straight[nproc]  # bit for bit, before and after the restart


@pytest.mark.slow("a launch, a rank killed mid-save and torchrun's restart")
@pytest.mark.parametrize("phase,victim", [("written", 0), ("writing", 1)])
def test_rank_killed_while_saving_uses_previous_checkpoint(phase, victim, straight, tmp_path):
    """A rank SIGKILLed during the step-8 save, once its files are written or as it starts
    writing them (its peer mid-save, in DCP's collectives): a rank failure, not a checkpoint
    error, so torchrun restarts the job (MAX_RESTARTS=1), which resumes from step 4 and ends
    with the uninterrupted run's losses."""
    dump = tmp_path / "run"
    proc = launch(
        2,
        [
            *BASE,
            *CK,
            *dp_batch(2),
            "--debug.kill_in_checkpoint_step",
            "8",
            "--debug.kill_in_checkpoint_phase",
            phase,
            "--debug.kill_rank",
            str(victim),
        ],
        dump,
        env={"MAX_RESTARTS": "1", "LOG_RANK": "0,1"},
        timeout=600,
    )
    assert "resumed from" in proc.stderr and "step-4 at step 4" in proc.stderr
    assert "checkpoint error" not in proc.stderr and "Traceback" not in proc.stderr
    if phase == "writing":
        # the survivor's account: its collective failed as the peer left, or torchrun's
        # agent stopped it first, whichever came first
        assert (
            "checkpoint step 8 was not written" in proc.stderr
            or "stopped by SIGTERM during step 8" in proc.stderr
        ), proc.stderr[-3000:]
    assert losses(dump) == straight[2]


def test_stuck_rank_fails_within_timeout_naming_it(tmp_path):
    t0 = time.monotonic()
    proc = launch(
        2,
        [
            *BASE,
            *dp_batch(2),
            "--debug.sleep_at_step",
            "3",
            "--debug.sleep_rank",
            "1",
            "--comm.train_timeout_seconds",
            "10",
        ],
        tmp_path,
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120  # not the hour-long sleep
    assert "rank 1: no training progress" in proc.stderr  # torchrun's root-cause report
    stacks = (tmp_path / "watchdog" / "rank1_stacks.txt").read_text()
    assert "in train_step" in stacks and "rank 1" in stacks
    assert not (tmp_path / "watchdog" / "rank0_stacks.txt").exists()


def test_unwritable_checkpoint_folder_fails_before_training(tmp_path):
    dump = tmp_path / "run"
    folder = dump / "checkpoint"
    folder.mkdir(parents=True)
    # chattr +i stops root too (tests may run as root, which ignores permission bits)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        if os.geteuid() == 0:
            pytest.skip("chattr is not permitted here and root ignores chmod")
        folder.chmod(0o555)
    try:
        proc = launch(1, [*BASE, *CK], dump, timeout=120, check=False)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)
    assert proc.returncode == 2
    assert "checkpoint.folder: cannot write" in proc.stderr and "not writable" in proc.stderr
    assert sorted(p.name for p in dump.iterdir()) == ["checkpoint"]
    assert list(folder.iterdir()) == []


def test_failed_run_reports_every_ranks_last_lines(tmp_path):
    # the console shows rank 0 only; the failure message must still show the rank that died
    with pytest.raises(RunFailed) as failed:
        launch(
            2,
            [
                *BASE,
                *CK,
                *dp_batch(2),
                "--training.steps",
                "4",
                "--checkpoint.interval",
                "2",
                "--debug.kill_in_checkpoint_step",
                "2",
                "--debug.kill_rank",
                "1",
            ],
            tmp_path / "run",
            timeout=300,
        )
    msg = str(failed.value)
    assert "local rank 1 ---" in msg and "local rank 0 ---" in msg
    assert "debug.kill_in_checkpoint_step: rank 1 kills itself now" in msg
    assert "titan: the run ended: rank 1 killed by SIGKILL" in msg  # the launcher's summary


def test_data_error_found_by_a_worker_is_one_line_not_retried(tmp_path):
    """A bad record past the lines the launcher checks is found while tokenizing, inside the
    worker: one line from the launcher, exit 2, and no restart, though MAX_RESTARTS allows 2."""
    bad = tmp_path / "corpus.jsonl"
    lines = [f'{{"text": "And God said, let there be light {i}."}}' for i in range(200)]
    lines[150] = "And there was light."  # not JSON
    bad.write_text("\n".join(lines) + "\n")
    logs = tmp_path / "logs"
    proc = launch(
        1,
        [*BASE, "--training.dataset_path", str(bad)],
        tmp_path / "run",
        env={
            "MAX_RESTARTS": "2",
            "PET_LOG_DIR": str(logs),
            "TITAN_CACHE_DIR": str(tmp_path / "cache"),
        },
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    # named by its line in the file, not by a row of the JSON reader's block
    line = f"titan: data error on rank 0: {bad}, line 151: not a JSON record (Expecting value"
    assert out.count(line) == 1, out[-3000:]
    assert "(not restarted: a restart would fail the same way)" in out
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert len(list(logs.glob("*/attempt_*"))) == 1  # started once
    assert out.count(f"ERROR {bad}, line 151") == 1  # the worker's own line, once


@pytest.mark.slow("two launches stopped by signals and their resumes")
def test_ctrl_c_and_sigterm_stop_in_a_few_lines_and_the_run_resumes(straight, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) and SIGTERM (to the launcher, as a
    scheduler sends it): exit 130 and 143, no traceback, a few lines saying where the next
    run starts; the checkpoints stay intact and the resumed runs end with the uninterrupted
    run's losses."""
    dump = tmp_path / "run"
    workers.hold(2)
    cmd, env = command(2, [*BASE, *CK, *dp_batch(2), "--checkpoint.interval", "2"], dump)
    for signum, at, code in ((signal.SIGINT, 5, 130), (signal.SIGTERM, 9, 143)):
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while max(losses(dump), default=0) < at:
                assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
                time.sleep(0.1)
            if signum == signal.SIGINT:
                os.killpg(proc.pid, signum)  # what the terminal does
            else:
                os.kill(proc.pid, signum)  # run_train.sh execs the launcher
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            kill_workers(dump)
        assert proc.returncode == code, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        lines = err.splitlines()
        last_step = max(i for i, line in enumerate(lines) if "step:" in line)
        after = lines[last_step + 1 :]
        assert len(after) <= 4, after
        name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"
        assert after[-1].startswith(f"titan: stopped by {name}; checkpoints in "), after
        assert "the next run resumes from it" in after[-1]
    launch(2, [*BASE, *CK, *dp_batch(2), "--checkpoint.interval", "2"], dump, timeout=600)
    assert losses(dump) == straight[2]


@pytest.mark.slow("a launch and a killed rank")
def test_a_rank_killed_without_restarts_ends_in_a_few_lines(tmp_path):
    """MAX_RESTARTS=0 and rank 1 SIGKILLed after the step-4 checkpoint: exit 1 with which rank
    died and how, where the next run resumes, and torchrun's report in a file it names: no
    traceback of the launcher's."""
    dump = tmp_path / "run"
    code, err = killed_run(2, 1, dump, restarts=0)
    assert code == 1, err[-3000:]
    assert "titan: the run ended: rank 1 killed by SIGKILL" in err, err[-3000:]
    # step 4's, or a later one where the kill came after it (the rank is killed past step 6)
    done = [p for p in (dump / "checkpoint").glob("step-*") if (p / ".complete").is_file()]
    newest = max(int(p.name.split("-")[1]) for p in done)
    assert newest >= 4 and f"the newest complete one is step-{newest}" in err, err[-3000:]
    (report,) = dump.glob("rank_failure_*.txt")
    assert f"torchrun's report is in {report}" in err and "SIGKILL" in report.read_text()
    launcher = [ln for ln in err.splitlines() if not ln.startswith("[rank")]
    assert not any("Traceback" in ln or "ChildFailedError" in ln for ln in launcher), err[-3000:]
