"""The memory planner's parameter, gradient and optimizer bytes equal what the trainer holds
at its first step, rank by rank, in every layout (forked ranks, 1 step each)."""

import json
import sys

import pytest

from tests.forked import run_trainer, run_workers, tiny_run
from titan.config import parse_args
from titan.memory_plan import state_bytes_per_rank

ONE_STEP = tiny_run(1)
LAYOUTS = {
    "1rank_bf16_states": (1, ["--optimizer.state_dtype", "bfloat16"]),
    "fsdp2_full_ac": (2, ["--activation_checkpoint.mode", "full"]),
    "fsdp2_tp2_selective_ac": (4, ["--parallelism.tensor_parallel_degree", "2",
                                   "--activation_checkpoint.mode", "selective"]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--training.local_batch_size", "2"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2",
                "--parallelism.data_parallel_shard_degree", "1"]),
    "pp2_1f1b_tied": (2, ["--parallelism.pipeline_parallel_degree", "2",
                          "--model.flavor", "debugmodel_tied"]),
    "pp2_interleaved": (2, ["--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                            "--parallelism.pipeline_parallel_layers_per_stage", "1"]),
}


def _plan_in_child(rank, world_size, argv, nproc):
    return state_bytes_per_rank(parse_args(argv), nproc)


def planned_bytes(argv, nproc, tmp_path) -> list[dict]:
    """The plan, made in a forked child: its fake process group and the meshes torch caches
    for it must not reach the ranks later tests fork from this process."""
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    return run_workers(_plan_in_child, 1, plan_dir, argv, nproc, init_pg=False,
                       barrier=False)[0]


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_planned_state_bytes_equal_measured(case, tmp_path):
    nproc, overrides = LAYOUTS[case]
    argv = [*ONE_STEP, *overrides]
    run_trainer(tmp_path, nproc, argv)
    measured = json.loads((tmp_path / "dump" / "memory_measured.json").read_text())["ranks"]
    planned = planned_bytes(argv, nproc, tmp_path)
    assert len(measured) == nproc
    for rank, (m, p) in enumerate(zip(measured, planned, strict=True)):
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert m[key] == p[key] > 0, (case, rank, key, m, p)


def test_plan_cli_json_and_errors(tmp_path):
    import subprocess

    from titan.paths import REPO_ROOT

    def plan(*args):
        return subprocess.run([sys.executable, "-m", "titan.plan", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)

    overrides = ["--parallelism.pipeline_parallel_degree", "2"]
    proc = plan("--ngpu", "4", "--device-memory", "1GiB", "--json", *overrides)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["layout"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 2}
    assert [r["rank"] for r in report["ranks"]] == [0, 2]  # one row per pipeline rank
    expected = planned_bytes(["--job.config_file", "train_configs/debug_model.toml",
                              *overrides], 4, tmp_path)
    for row in report["ranks"]:
        want = expected[row["rank"]]
        assert {k: row[k] for k in want} == want
        assert row["states_bytes"] == sum(want.values())
    assert report["headroom_bytes"] == 2**30 - report["max_states_bytes"]
    assert report["not_included"] == ["activations", "transient buffers"]
    table = plan("--ngpu", "4", *overrides).stdout
    assert "optimizer" in table and "not included yet" in table
    bad = plan("--ngpu", "3", "--parallelism.tensor_parallel_degree", "2")
    assert bad.returncode == 2 and "world size 3 is not divisible" in bad.stderr


def test_launcher_refuses_states_that_cannot_fit():
    import os
    import subprocess

    from titan.paths import REPO_ROOT

    def dry_run(*overrides):
        return subprocess.run(["bash", "run_train.sh", *overrides], cwd=REPO_ROOT,
                              env={**os.environ, "DRY_RUN": "1", "NGPU": "2"},
                              capture_output=True, text=True, timeout=120)

    small = ["--memory.device_memory_gib", "0.035"]  # FSDP 2: 44 MiB of states per rank
    proc = dry_run(*small)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "rank 0 would hold 44.0 MiB" in proc.stderr and "device's 35.8 MiB" in proc.stderr
    assert "biggest item: optimizer" in proc.stderr and 'state_dtype = "bfloat16"' in proc.stderr
    warned = dry_run(*small, "--memory.check", "warn")
    assert warned.returncode == 0 and "titan: warning: rank 0 would hold" in warned.stderr
    for fits in (["--optimizer.state_dtype", "bfloat16"], ["--training.enable_cpu_offload"]):
        proc = dry_run(*small, *fits)  # 33 MiB with bf16 moments; offloaded: on the host
        assert proc.returncode == 0 and "would hold" not in proc.stderr, proc.stderr
