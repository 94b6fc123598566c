"""run_train.sh's environment (NGPU, LOG_RANK) and python -m titan.planner's rank counts: a
value that names no rank count or no local rank is one "titan: config error" line and exit 2,
before torchrun starts (NGPU=0 used to stop bash on a division by zero first). Their output
into a pipe closed early (`--help | head`) ends quietly, as GNU tools do."""

import os
import subprocess

import pytest

from titan.config import ConfigError
from titan.launcher.launch import check_log_ranks, ranks_per_node
from titan.runtime.paths import REPO_ROOT


def test_ranks_per_node():
    assert ranks_per_node("8") == 8
    for bad in ("0", "abc", "-1", "auto", ""):
        with pytest.raises(
            ConfigError, match=f"NGPU={bad!r}: the ranks per node must be a whole number >= 1"
        ):
            ranks_per_node(bad)


def test_log_ranks_must_be_local_ranks():
    check_log_ranks("0,3", 4)
    check_log_ranks("", 1)  # torchrun's default: every rank
    with pytest.raises(
        ConfigError,
        match=r"LOG_RANK=5: this node has no local rank 5 "
        r"\(NGPU=2: ranks 0 to 1\)",
    ):
        check_log_ranks("5", 2)
    with pytest.raises(ConfigError, match="LOG_RANK=0,-1: this node has no local rank -1"):
        check_log_ranks("0,-1", 2)
    with pytest.raises(ConfigError, match="LOG_RANK='x': a comma-separated list of local ranks"):
        check_log_ranks("x", 2)


@pytest.mark.parametrize(
    "env,why",
    [
        ({"NGPU": "0"}, "NGPU='0': the ranks per node must be a whole number >= 1"),
        ({"NGPU": "abc"}, "NGPU='abc': the ranks per node must be a whole number >= 1"),
        ({"NGPU": "2", "LOG_RANK": "5"}, "LOG_RANK=5: this node has no local rank 5"),
        (
            {"NNODES": "4:2", "RDZV_ENDPOINT": "localhost:29500"},
            "NNODES='4:2': a node count >= 1 (e.g. NNODES=4), or MIN:MAX with 1 <= MIN <= MAX",
        ),
        ({"NNODES": "0:2", "RDZV_ENDPOINT": "localhost:29500"}, "NNODES='0:2': a node count >= 1"),
        (
            {"NNODES": "2", "NODE_RANK": "5", "RDZV_ENDPOINT": "localhost:29500"},
            "NODE_RANK=5: a job of 2 node(s) has node ranks 0 to 1; unset NODE_RANK",
        ),
    ],
)
def test_run_train_sh_refuses_bad_env_in_one_line(env, why, tmp_path):
    proc = subprocess.run(
        ["bash", "run_train.sh", "--job.dump_folder", str(tmp_path / "d")],
        cwd=REPO_ROOT,
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"titan: config error: {why}")
    assert proc.stderr.count("\n") == 1, proc.stderr  # no bash error before it
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flag", ["--ngpu", "--nnodes"])
def test_plan_refuses_zero_ranks(flag, capsys):
    from titan.planner.cli import main

    assert main([flag, "0"]) == 2
    err = capsys.readouterr().err
    assert err == f"titan: config error: {flag} 0: must be >= 1 ({flag} 1 plans one process)\n"


def _into_a_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    """argv with stdout a pipe whose reader is gone before it writes (head that exited)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            argv, cwd=REPO_ROOT, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)


def test_help_into_a_closed_pipe_ends_quietly():
    proc = _into_a_closed_pipe(["bash", "run_train.sh", "--help"])
    assert proc.stderr == "" and proc.returncode == 141  # 128 + SIGPIPE, as a shell reports it


def test_plan_into_a_closed_pipe_ends_quietly():
    import sys

    proc = _into_a_closed_pipe([sys.executable, "-m", "titan.planner", "--help"])
    assert proc.stderr == "" and proc.returncode == -13  # killed by SIGPIPE
