"""A RunPlan is resolved once per process: the tokenizer is read and every pipeline rank's
stages planned once, and the launcher's checks, the planner (over every pipeline rank) and a
trainer read that plan instead of the config again. Each case runs in a forked child: the
planner's fake process group must not reach the ranks later tests fork."""

import collections
import sys

import pytest

from tests.forked import free_port, run_workers, tiny_run

CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def _count_plan_work() -> collections.Counter:
    """Counts, in this process, the reads of the tokenizer, the pipeline plans made from the
    config and the plan_run calls."""
    import titan.plan.run_plan as preflight

    counts = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    preflight.Tokenizer = counted("tokenizer", preflight.Tokenizer)
    preflight.plan_pipelines = counted("pipeline plans", preflight.plan_pipelines)
    preflight.plan_run = counted("plan_run", preflight.plan_run)
    return counts


def _planner(rank, world_size, argv):
    from titan.planner.cli import main

    counts = _count_plan_work()
    assert main(argv) == 0
    return dict(counts)


def _launcher_checks(rank, world_size, argv, dump):
    from titan.config import parse_args
    from titan.launcher.launch import validate_world_sizes

    counts = _count_plan_work()
    job = parse_args([*argv, "--job.dump_folder", dump])
    # the launcher's main, up to torchrun: its plan checks read the data, the checkpoints and
    # the memory plan
    validate_world_sizes(job, 1, 1, 2)
    return dict(counts)


def _trainer(rank, world_size, port, argv):
    from tests.forked import build_trainer

    counts = _count_plan_work()
    trainer = build_trainer(rank, world_size, port, argv)
    try:
        trainer.train()  # a step and a validation: the eval schedule's stages too
    finally:
        trainer.close()
    return dict(counts)


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_the_planner_plans_once_over_two_pipeline_ranks(tmp_path):
    counts = run_workers(
        _planner,
        1,
        tmp_path,
        ["--ngpu", "2", "--device-memory", "1GiB", *CONFIG, *PP2],
        init_pg=False,
        barrier=False,
    )[0]
    assert counts == {"tokenizer": 1, "pipeline plans": 1, "plan_run": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_suggest_reads_the_tokenizer_once(tmp_path):
    argv = ["--ngpu", "2", "--suggest", "--device-memory", "1GiB", *CONFIG]
    counts = run_workers(_planner, 1, tmp_path, argv, init_pg=False, barrier=False)[0]
    # one plan per candidate layout (each another config), the tokenizer read once
    assert counts["tokenizer"] == 1 and counts["plan_run"] > 1


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_the_launcher_plans_once(tmp_path):
    argv = [*CONFIG, *PP2, "--memory.device_memory_gib", "80"]
    counts = run_workers(
        _launcher_checks, 1, tmp_path, argv, str(tmp_path / "dump"), init_pg=False, barrier=False
    )[0]
    assert counts == {"tokenizer": 1, "pipeline plans": 1, "plan_run": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_each_trainer_rank_plans_once(tmp_path):
    argv = [
        *tiny_run(1),
        *PP2,
        "--validation.enable",
        "--validation.steps",
        "1",
        "--validation.local_batch_size",
        "2",
        "--validation.freq",
        "1",
        "--job.dump_folder",
        str(tmp_path / "dump"),
    ]
    per_rank = run_workers(_trainer, 2, tmp_path, free_port(), argv, init_pg=False)
    # pipeline plans: one for training batches, one for validation batches
    assert per_rank == [{"tokenizer": 1, "pipeline plans": 2, "plan_run": 1}] * 2
