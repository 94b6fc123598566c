"""scripts/multinode_trainer.slurm --dry-run outside a SLURM allocation: the nodes and ranks per
node come from --nodes / --gpus-per-node, and every node's torchrun command is printed."""

import os
import subprocess

from titan.runtime.paths import REPO_ROOT

SCRIPT = str(REPO_ROOT / "scripts" / "multinode_trainer.slurm")


def run(*argv):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("NNODES", "NGPU", "RDZV_ID", "NODE_LIST")
    }
    return subprocess.run(
        ["bash", SCRIPT, *argv], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_dry_run_with_named_nodes_prints_every_command(tmp_path):
    dump = tmp_path / "d"
    proc = run(
        "--dry-run",
        "--nodes",
        "host-a,host-b,host-c",
        "--gpus-per-node",
        "2",
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(dump),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split(": ", 1)[0] for ln in lines] == [
        "node 0 (host-a)",
        "node 1 (host-b)",
        "node 2 (host-c)",
    ]
    ids = set()
    for rank, line in enumerate(lines):
        cmd = line.split(": ", 1)[1]
        assert cmd.startswith("torchrun ")
        assert cmd.endswith(
            f"-m titan.trainer --job.config_file train_configs/debug_model.toml "
            f"--training.steps 3 --job.dump_folder {dump}"
        )
        for flag in (
            "--nnodes=3",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=host-a:29500",
            f"--node-rank={rank}",
            "--nproc_per_node=2",
        ):
            assert f" {flag} " in cmd, (flag, cmd)
        # no SLURM job id: the launcher derives one every node shares
        ids |= {w for w in cmd.split() if w.startswith("--rdzv-id=titan-")}
    assert len(ids) == 1
    assert not dump.exists()


def test_outside_an_allocation_it_says_what_to_pass():
    proc = run("--training.steps", "3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "titan: config error: not inside a SLURM allocation (SLURM_JOB_NODELIST is unset): "
        "submit with sbatch, or name the nodes for a dry run: --dry-run --nodes node01,node02 "
        "--gpus-per-node 8\n"
    )
    proc = run("--nodes", "host-a,host-b")  # srun would not use them
    assert proc.returncode == 2 and "names nodes for --dry-run only" in proc.stderr
    proc = run("--dry-run", "--nodes")
    assert proc.returncode == 2 and proc.stderr.startswith(
        "titan: config error: --nodes needs a value"
    )
