"""Every data/tensor-parallel layout trains to the 1-rank losses (CPU, gloo, fp32).

Each case is the real trainer on its ranks (forked on CPU, launched on CUDA: see
harness.train_layout) compared step by step with one 1-rank baseline run on the same seed and
data: the global batch (8 sequences) is the same set of sequences in every layout, and every
layout starts from the same weights. FSDP 4 and HSDP 2x2 are checked the same way across two
simulated nodes, launched (test_multinode.py).
"""

import pytest

from tests.integration.harness import (
    COMMON,
    GLOBAL_BATCH,
    assert_matches_baseline,
    dp_batch,
    launch,
)

CASES = {
    "fsdp2": (2, dp_batch(2)),
    "ddp2": (
        2,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            *dp_batch(2),
        ],
    ),
    "tp2_sp_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2", *dp_batch(1)]),
    "tp2_no_loss_parallel": (
        2,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.disable_loss_parallel",
            *dp_batch(1),
        ],
    ),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", *dp_batch(2)]),
    "hsdp2x2_tp2": (
        8,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            *dp_batch(4),
        ],
    ),
    "fsdp2_full_ac": (2, ["--activation_checkpoint.mode", "full", *dp_batch(2)]),
    "fsdp2_selective_op_ac": (
        2,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            *dp_batch(2),
        ],
    ),
    "fsdp2_compile": (2, ["--compile.enable", *dp_batch(2)]),
    "fsdp2_cpu_offload": (2, ["--training.enable_cpu_offload", *dp_batch(2)]),
    "grad_accum_4x": (
        1,
        ["--training.local_batch_size", "2", "--training.global_batch_size", str(GLOBAL_BATCH)],
    ),
}


@pytest.mark.slow("layouts of up to 8 ranks on the machine's cores")
@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case, baseline, tmp_path):
    nproc, overrides = CASES[case]
    assert_matches_baseline(baseline, nproc, overrides, tmp_path, case)


def test_layout_errors_are_reported_before_launch(tmp_path):
    proc = launch(
        4,
        [*COMMON, "--parallelism.tensor_parallel_degree", "3"],
        tmp_path / "x",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "world size 4 is not divisible" in proc.stderr
    proc = launch(
        2,
        [
            *COMMON,
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--training.local_batch_size",
            "3",
            "--training.global_batch_size",
            "8",
        ],
        tmp_path / "y",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "global_batch_size 8 must be a multiple" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
