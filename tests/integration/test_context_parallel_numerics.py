"""Context parallelism (ring attention over CPU SDPA here), alone and composed up to 4-D,
trains to the 1-rank losses."""

import pytest

from tests.integration.harness import COMMON, assert_matches_baseline, dp_batch, launch


def cp(n, method="allgather"):
    return [
        "--parallelism.context_parallel_degree",
        str(n),
        "--parallelism.context_parallel_rotate_method",
        method,
    ]


@pytest.mark.slow("CP composed with FSDP, HSDP, TP and PP: up to 8 ranks")
@pytest.mark.parametrize(
    "case,nproc,overrides",
    [
        ("cp2_allgather", 2, [*cp(2), *dp_batch(1)]),
        ("cp2_alltoall", 2, [*cp(2, "alltoall"), *dp_batch(1)]),
        ("cp4", 4, [*cp(4), *dp_batch(1)]),
        ("cp2_fsdp2", 4, [*cp(2), *dp_batch(2)]),
        ("cp2_tp2", 4, [*cp(2), "--parallelism.tensor_parallel_degree", "2", *dp_batch(1)]),
        (
            "hsdp2x2_cp2",
            8,
            [*cp(2), "--parallelism.data_parallel_replicate_degree", "2", *dp_batch(4)],
        ),
        ("pp2_fsdp2_cp2", 8, [*cp(2), "--parallelism.pipeline_parallel_degree", "2", *dp_batch(2)]),
    ],
)
def test_cp_layout_matches_single_process(case, nproc, overrides, baseline, tmp_path):
    assert_matches_baseline(baseline, nproc, overrides, tmp_path, case)


def test_cp_seq_len_must_split_into_2cp_chunks(tmp_path):
    proc = launch(
        4, [*COMMON, *cp(4), "--training.seq_len", "60"], tmp_path / "x", check=False, timeout=120
    )
    assert proc.returncode == 2
    assert "seq_len 60 must be divisible by 2 x context_parallel_degree = 8" in proc.stderr
    assert not (tmp_path / "x").exists()
