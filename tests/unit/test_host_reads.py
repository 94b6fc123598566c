"""The host reads of a training step that is not logged: none with the default config, one
(all the figures in one copy) where a component decides on every step's figures.

A read (`.item()`, `.tolist()`, `bool`/`float`/`int` of a tensor) makes the host wait for the
device: on a GPU it stops the host from queueing the next kernels, and a step with one cannot
be captured in a CUDA graph. Counted by wrapping those Tensor methods in a forked rank of the
real Trainer, per step (the step the trainer is in when the read happens); a run logs only
its first and last steps, so its middle steps are the ones a log does not read."""

import collections
import json
import traceback

import pytest
import torch

from tests.forked import build_trainer, free_port, run_workers, tiny_run

READS = ("item", "tolist", "__bool__", "__float__", "__int__")
STEPS = 6


def _count_reads(rank, world_size, port, argv):
    trainer = build_trainer(rank, world_size, port, argv)
    per_step, where = collections.Counter(), collections.defaultdict(set)

    def counting(name, original):
        def read(self, *args, **kwargs):
            per_step[trainer.step] += 1
            caller = traceback.extract_stack(limit=2)[0]
            where[trainer.step].add(f"{caller.filename.split('titan/')[-1]}:{caller.lineno}")
            return original(self, *args, **kwargs)

        return read

    originals = {name: getattr(torch.Tensor, name) for name in READS}
    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        trainer.train()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        trainer.close()
    return dict(per_step), {k: sorted(v) for k, v in where.items()}


def reads_per_step(tmp_path, *overrides) -> tuple[dict, dict]:
    """(host reads of each unlogged step, where they were made)."""
    argv = [
        *tiny_run(STEPS),
        "--metrics.log_freq",
        "1000",  # logs steps 1 and STEPS only
        "--job.dump_folder",
        str(tmp_path / "dump"),
        *overrides,
    ]
    counts, where = run_workers(_count_reads, 1, tmp_path, free_port(), argv, init_pg=False)[0]
    middle = range(2, STEPS)
    return {s: counts.get(s, 0) for s in middle}, {s: where.get(s) for s in middle}


def test_an_unlogged_step_reads_nothing_on_the_host(tmp_path):
    counts, where = reads_per_step(tmp_path)
    assert set(counts.values()) == {0}, where


@pytest.mark.parametrize(
    "overrides",
    [
        # the spike monitor judges each step's loss and gradient norm before its update
        ["--stability.spike_window", "4"],
        # a skipped update is decided before it
        ["--training.on_nonfinite", "skip"],
    ],
    ids=["stability", "nonfinite_skip"],
)
def test_a_component_that_decides_on_each_step_costs_one_read(tmp_path, overrides):
    counts, where = reads_per_step(tmp_path, *overrides)
    assert set(counts.values()) == {1}, where  # the figures, all in one copy


def test_a_bad_step_found_on_the_device_stops_the_run_before_a_log_or_a_save(tmp_path):
    """training.on_nonfinite = "stop" without a read a step: a NaN at step 3 of a run that
    logs every 5 steps and saves at step 4 stops the run at step 4's save, naming step 3;
    nothing after step 2 is logged or saved."""
    from tests.forked import run_trainer

    argv = [
        *tiny_run(8),
        "--metrics.log_freq",
        "5",
        "--debug.nan_at_step",
        "3",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    with pytest.raises(pytest.fail.Exception) as e:
        run_trainer(tmp_path, 1, argv)
    assert "NonFiniteLossError: non-finite loss (nan) or grad norm (nan) at step 3" in str(e.value)
    dump = tmp_path / "dump"
    records = (dump / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in records]
    assert logged == [1]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
