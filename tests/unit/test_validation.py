"""Validation batches are global: `validation.global_batch_size` sequences over all data-parallel
ranks, each rank taking its slice in forwards of `validation.local_batch_size`, so val_loss is
the same on every layout (and whatever the forwards' size)."""

import json
import sys

import pytest

from tests.forked import run_trainer, tiny_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

VAL = [*tiny_run(1), "--validation.enable", "--validation.freq", "1", "--validation.steps", "2"]


def val_loss(tmp_path, world, *flags) -> float:
    run_trainer(tmp_path, world, [*VAL, *flags])
    (record,) = [
        json.loads(x) for x in (tmp_path / "dump" / "validation.jsonl").read_text().splitlines()
    ]
    return record["val_loss"]


def test_val_loss_is_the_same_on_every_layout(tmp_path):
    batch = ["--validation.global_batch_size", "8"]
    one = val_loss(tmp_path / "one", 1, *batch)
    layouts = {
        # each rank validates 4 of the 8 sequences, in forwards of 2
        "fsdp2": (
            2,
            ["--parallelism.data_parallel_shard_degree", "2", "--validation.local_batch_size", "2"],
        ),
        "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    }
    for name, (world, flags) in layouts.items():
        got = val_loss(tmp_path / name, world, *batch, *flags)
        assert abs(got - one) <= 1e-5 * one, (name, got, one)
    # a per-rank batch (the global size unset) validates dp times the sequences: another loss
    per_rank = ["--validation.local_batch_size", "4"]
    assert val_loss(
        tmp_path / "fsdp2_local", 2, *per_rank, "--parallelism.data_parallel_shard_degree", "2"
    ) != pytest.approx(val_loss(tmp_path / "one_local", 1, *per_rank), rel=1e-4)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--validation.global_batch_size", "6"],
            r"validation\.global_batch_size = 6 .*must split evenly over the 4 data-parallel ranks",
        ),
        (
            ["--validation.global_batch_size", "8", "--validation.local_batch_size", "3"],
            r"validation\.local_batch_size = 3 .*must divide each rank's share of a validation "
            r"batch, "
            r"global_batch_size / dp = 8 / 4 = 2",
        ),
    ],
)
def test_validation_batches_that_do_not_split_are_refused(flags, message, tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    with pytest.raises(ConfigError, match=message):
        plan_run(parse_args(["--validation.enable", *flags, "--job.dump_folder", str(tmp_path)]), 4)
