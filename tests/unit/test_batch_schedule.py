"""training.global_batch_schedule: a batch-size ramp trains the stream as runs of those sizes
would, on every layout and across a resume in the middle of the ramp."""

import shutil

import pytest

from tests.forked import TWO_RANK_LAYOUTS, run_trainer, tiny_run
from titan.plan.batch_schedule import BatchSchedule

# local batches of 2: global batches of 4, 8 and 16 divide on 1 and 2 data-parallel ranks
BASE = [*tiny_run(6), "--training.local_batch_size", "2", "--training.global_batch_size", "8"]
RAMP = ["--training.global_batch_schedule", "1:4,3:8,5:16"]
SIZES = [4, 4, 8, 8, 16, 16]
CK = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
SEQ = 32


def losses(rows) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def ramp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    return run_trainer(tmp, 1, [*BASE, *RAMP, *CK], deadline_s=120), tmp / "dump"


def test_the_schedule_names_each_steps_size():
    s = BatchSchedule(8, ((1, 4), (3, 8), (5, 16)), "sqrt")
    assert [s.size_at(k) for k in range(1, 7)] == SIZES
    assert BatchSchedule(8, ((3, 16),)).size_at(2) == 8  # before the first entry: the base
    assert s.lr_factor(1) == pytest.approx(0.5**0.5) and s.lr_factor(6) == pytest.approx(2**0.5)


def test_a_ramp_trains_the_stream_as_runs_of_those_sizes(ramp, tmp_path):
    """Steps 1-2 at 4, 3-4 at 8, 5-6 at 16 sequences: the same losses, bitwise, as a run at 4
    resumed at 8, resumed at 16 (a resume onto another size continues at the first sequence
    not yet trained); the tokens counted are the sizes' sum."""
    rows, _ = ramp
    for size, stop in ((4, 2), (8, 4), (16, 6)):  # each resuming the last one's checkpoint
        argv = [*BASE, *CK, "--training.global_batch_size", str(size)]
        pieces = run_trainer(tmp_path, 1, [*argv, "--training.exit_at_step", str(stop)])
    assert losses(rows) == losses(pieces)
    seen = [sum(SIZES[:k]) * SEQ for k in range(1, 7)]
    assert [r["tokens_seen"] for r in rows] == seen


LAYOUTS = TWO_RANK_LAYOUTS


@pytest.mark.slow("a 2-rank training of 6 steps")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_ramps_as_one_rank(ramp, tmp_path, layout):
    rows, _ = ramp
    got = run_trainer(tmp_path, 2, [*BASE, *RAMP, *LAYOUTS[layout]], deadline_s=180)
    assert losses(got) == pytest.approx(losses(rows), rel=1e-5)
    assert [r["tokens_seen"] for r in got] == [r["tokens_seen"] for r in rows]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_inside_the_ramp_continues_it(ramp, tmp_path, nproc):
    """From step 4's checkpoint (size 8, the next step's 16): bitwise on 1 rank; on 2 (FSDP 2)
    within 1e-5."""
    rows, dump = ramp
    shutil.copytree(dump / "checkpoint" / "step-4", tmp_path / "dump" / "checkpoint" / "step-4")
    resumed = run_trainer(tmp_path, nproc, [*BASE, *RAMP, *CK], deadline_s=120)
    if nproc == 1:
        assert losses(resumed) == losses(rows[4:])
    else:
        assert losses(resumed) == pytest.approx(losses(rows[4:]), rel=1e-5)
    assert [r["tokens_seen"] for r in resumed] == [r["tokens_seen"] for r in rows[4:]]


def test_the_lr_follows_the_size(ramp, tmp_path):
    rows, _ = ramp
    scaled = run_trainer(tmp_path, 1, [*BASE, *RAMP, "--training.batch_lr_scaling", "sqrt"])
    for plain, got, size in zip(rows, scaled, SIZES):
        assert got["lr"] == pytest.approx(plain["lr"] * (size / 8) ** 0.5, rel=1e-6)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["1:6"], r"'1:6': a global batch of 6 sequences is not a multiple of 4"),
        (["1:4,1:8"], r"'1:8': steps start at 1 and increase"),
        (["0:4"], r"'0:4': steps start at 1"),
        (["4"], r"'4' is not 'step:size'"),
    ],
)
def test_a_schedule_the_layout_cannot_divide_is_refused(flags, message):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    dp2 = ["--parallelism.data_parallel_shard_degree", "2"]
    job = parse_args([*BASE, *dp2, "--training.global_batch_schedule", *flags])
    with pytest.raises(ConfigError, match=message):
        plan_run(job, 2)


def test_streamed_data_cannot_ramp():
    from titan.config import ConfigError, parse_args

    # the config alone refuses it, before any plan
    with pytest.raises(ConfigError, match="needs a local dataset without"):
        parse_args([*BASE, *RAMP, "--training.dataset_streaming"])


def test_lr_scaling_without_a_schedule_is_refused():
    from titan.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match="training.global_batch_schedule is empty"):
        parse_args([*BASE, "--training.batch_lr_scaling", "sqrt"])
