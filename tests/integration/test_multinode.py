"""Several nodes through torchrun's c10d rendezvous (simulated on 127.0.0.1: one torchrun agent
per node, as on a cluster), an elastic job that loses a node and goes on, and the SLURM
script's per-node commands."""

import os
import re
import subprocess
import time

import pytest

from tests.integration.harness import (
    COMMON,
    GLOBAL_BATCH,
    RTOL,
    STEPS,
    Nodes,
    assert_records_match,
    compare,
    dp_batch,
    format_table,
    losses,
    read_metrics,
)
from titan.runtime.paths import REPO_ROOT

HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]  # replicas across the two nodes


def assert_close(reference: list[dict], records: list[dict], case: str) -> None:
    rows = compare(reference, records, "loss")
    print(format_table(rows, "loss", "reference", case))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert max(d for *_, d in rows) <= RTOL, format_table(rows, "loss", "reference", case)


@pytest.fixture(scope="module")
def fsdp4_on_two_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp4_nodes")
    with Nodes(2, 2, [*COMMON, *dp_batch(4)], tmp / "dump", tmp) as nodes:
        outs = nodes.wait(timeout=600)
    for code, _, _ in outs:
        assert code == 0, nodes.rank_tails()
    return read_metrics(tmp / "dump")


# FSDP 4 and HSDP 2x2 are proven here, across nodes, rather than again on one node: the same
# layouts and numerics, only the rendezvous differs
def test_fsdp4_across_two_nodes(fsdp4_on_two_nodes, baseline):
    assert_records_match(baseline, fsdp4_on_two_nodes, 4, "FSDP 4 on 2 nodes x 2 ranks")


def test_hsdp_2x2_across_two_nodes(baseline, tmp_path):
    with Nodes(2, 2, [*COMMON, *HSDP, *dp_batch(4)], tmp_path / "dump", tmp_path) as nodes:
        outs = nodes.wait(timeout=600)
    assert all(code == 0 for code, _, _ in outs), nodes.rank_tails()
    assert "dp_replicate=2, dp_shard=2" in outs[0][2]  # the layout rank 0 logged
    assert_records_match(baseline, read_metrics(tmp_path / "dump"), 4, "HSDP 2x2 on 2 nodes")


@pytest.mark.slow("two torchrun agents, a killed node, the survivor's re-rendezvous and resume")
def test_elastic_job_loses_a_node_and_goes_on(fsdp4_on_two_nodes, tmp_path):
    """NNODES=1:2: the second node dies mid-run; the first re-rendezvouses alone and resumes
    from the newest checkpoint on 2 ranks, dp 4 -> 2 with twice the gradient accumulation."""
    dump = tmp_path / "dump"
    overrides = [
        *COMMON,
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        str(GLOBAL_BATCH),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
    ]
    # last_call_timeout: how long a rendezvous that has its minimum (1 node) waits for more
    with Nodes(
        2,
        2,
        overrides,
        dump,
        tmp_path,
        nnodes="1:2",
        env={"MAX_RESTARTS": "3"},
        rdzv_conf="last_call_timeout=8",
    ) as nodes:
        deadline = time.monotonic() + 300
        while max(losses(dump), default=0) < 3:  # past the step-2 checkpoint
            assert all(p.poll() is None for p in nodes.procs), nodes.rank_tails()
            assert time.monotonic() < deadline, nodes.rank_tails()
            time.sleep(0.1)
        killed_at = max(losses(dump))
        nodes.kill(1)
        (code, _, err), _ = nodes.wait(timeout=600)
    assert code == 0, nodes.rank_tails()
    assert killed_at < STEPS, "the run ended before the node died: nothing was tested"
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none missing or twice
    assert_close(fsdp4_on_two_nodes, records, "4 ranks, then 2 after a node died")
    change = re.search(
        r"layout change: step-(\d+) was saved on another parallel layout "
        r"\(([^)]*)\)",
        err,
    )
    assert change, err[-3000:]
    print(f"node 1 killed after step {killed_at}; {change[0]}")
    assert "world_size 4 -> 2" in change[2] and "grad_accum_steps 1 -> 2" in change[2]
    assert int(change[1]) <= killed_at


def launch_env(**env) -> dict:
    return {**os.environ, "NGPU": "2", **env}


def run_train(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO_ROOT / "run_train.sh"), *args],
        env=launch_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_launcher_validates_the_real_world_size(tmp_path):
    dump = str(tmp_path / "never")
    two_nodes = dict(NNODES="2", RDZV_ENDPOINT="127.0.0.1:29999", DRY_RUN="1")
    # 2 nodes x 2 ranks = 4: tp 3 does not divide it
    proc = run_train(
        "--parallelism.tensor_parallel_degree", "3", "--job.dump_folder", dump, **two_nodes
    )
    assert proc.returncode == 2 and "world size 4 is not divisible" in proc.stderr
    # elastic: every node count in the range must work, with a fixed global batch
    proc = run_train("--job.dump_folder", dump, **{**two_nodes, "NNODES": "1:2"})
    assert proc.returncode == 2 and "training.global_batch_size" in proc.stderr
    proc = run_train(
        "--parallelism.tensor_parallel_degree",
        "4",
        "--training.global_batch_size",
        "8",
        "--job.dump_folder",
        dump,
        **{**two_nodes, "NNODES": "1:2"},
    )
    assert proc.returncode == 2 and "with 1 of NNODES=1:2 nodes (2 ranks)" in proc.stderr
    proc = run_train("--job.dump_folder", dump, NNODES="2")
    assert proc.returncode == 2 and "RDZV_ENDPOINT" in proc.stderr
    assert not (tmp_path / "never").exists()


def test_slurm_script_dry_run(tmp_path):
    """Fake SLURM variables and scontrol for a 2-node allocation: the script prints each
    node's torchrun command with the first host as the endpoint and the job id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu-node-[07-08]" ] && '
        'printf "gpu-node-07\\ngpu-node-08\\n"\n'
    )
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_JOB_ID": "4242",
    }
    env.pop("NGPU", None)
    proc = subprocess.run(
        [
            str(REPO_ROOT / "scripts" / "multinode_trainer.slurm"),
            "--dry-run",
            "--training.steps",
            "3",
            "--job.dump_folder",
            str(tmp_path / "d"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
    assert [ln.split(":")[0] for ln in lines] == ["node 0 (gpu-node-07)", "node 1 (gpu-node-08)"]
    for rank, line in enumerate(lines):
        cmd = line.split(": ", 1)[1]
        assert cmd.startswith("torchrun ") and cmd.endswith(
            f"--training.steps 3 --job.dump_folder {tmp_path / 'd'}"
        )
        for flag in (
            "--nnodes=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=gpu-node-07:29500",
            f"--node-rank={rank}",
            "--rdzv-id=4242",
            "--nproc_per_node=2",
            "-m titan.trainer",
        ):
            assert flag in cmd, (flag, cmd)
    assert not (tmp_path / "d").exists()
