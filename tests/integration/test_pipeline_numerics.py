"""Pipeline parallelism with every torch schedule, and composed with FSDP and TP, trains to
the 1-rank losses; the logged loss is the real last-stage loss."""

import json

import pytest

from tests.integration.harness import (
    COMMON,
    RTOL,
    assert_matches_baseline,
    dp_batch,
    launch,
    train,
)

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_schedule(schedule, baseline, tmp_path):
    records = assert_matches_baseline(
        baseline,
        2,
        [*PP2, "--parallelism.pipeline_parallel_schedule", schedule, *dp_batch(1)],
        tmp_path,
        f"pp2 {schedule}",
    )
    assert all(r["loss"] > 0 for r in records)


@pytest.mark.slow("pipelines composed with FSDP and TP: up to 8 ranks, one compiled")
@pytest.mark.parametrize(
    "case,nproc,overrides",
    [
        ("pp2_fsdp2", 4, [*PP2, *dp_batch(2)]),
        ("pp2_tp2", 4, [*PP2, "--parallelism.tensor_parallel_degree", "2", *dp_batch(1)]),
        (
            "pp2_fsdp2_tp2",
            8,
            [
                *PP2,
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                *dp_batch(2),
            ],
        ),
        (
            "pp2_fsdp2_full_ac_compile",
            4,
            [*PP2, "--activation_checkpoint.mode", "full", "--compile.enable", *dp_batch(2)],
        ),
        (
            "pp2_split_points",
            2,
            [*PP2, "--parallelism.pipeline_parallel_split_points", "layers.2", *dp_batch(1)],
        ),
    ],
)
def test_pp_composed(case, nproc, overrides, baseline, tmp_path):
    assert_matches_baseline(baseline, nproc, overrides, tmp_path, case)


def test_pp_validation_loss_matches_single_process(tmp_path):
    val = [
        "--validation.enable",
        "--validation.freq",
        "2",
        "--validation.steps",
        "2",
        "--validation.local_batch_size",
        "8",
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "8",
    ]
    train(1, [*COMMON, *val], tmp_path / "one", timeout=300)
    train(2, [*COMMON, *val, *PP2], tmp_path / "pp", timeout=300)
    one, pp = (
        [json.loads(x) for x in (tmp_path / d / "validation.jsonl").read_text().split("\n") if x]
        for d in ("one", "pp")
    )
    assert [v["step"] for v in pp] == [2]
    assert abs(one[0]["val_loss"] - pp[0]["val_loss"]) <= RTOL * one[0]["val_loss"]


def test_pp_layout_errors(tmp_path):
    proc = launch(
        2,
        [*COMMON, *PP2, "--parallelism.pipeline_parallel_schedule", "1f1b_typo"],
        tmp_path / "a",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown pipeline_parallel_schedule" in proc.stderr
    proc = launch(
        2,
        [*COMMON, *PP2, "--training.local_batch_size", "1"],
        tmp_path / "b",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "cannot fill 2 pipeline ranks" in proc.stderr
    proc = launch(
        2,
        [
            *COMMON,
            *PP2,
            "--parallelism.pipeline_parallel_schedule",
            "DualPipeV",
            "--training.local_batch_size",
            "2",
        ],
        tmp_path / "c",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "at least as many microbatches as stages" in proc.stderr
