"""The planner's own defects, each once a silent wrong answer: activations it could not trace
counted as 0 by the launcher's memory check; one pipeline rank's figures reused for another
of the same layer count but other blocks or another place in the schedule; --suggest's
settings set past the config parser. Planner runs fork a child: its fake process group must
not reach the ranks later tests fork."""

import dataclasses
import sys

import pytest

from tests.forked import run_workers
from titan.config import ConfigError, parse_args
from titan.config.manager import source_of
from titan.planner.layout_search import LAYOUT_FIELDS, apply_settings, settings

CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]
needs_fork = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")


def job(*argv):
    j = parse_args([*CONFIG, *argv])
    j.plan_only = True
    return j


# ----------------------------------------------------------------------------- unknown != 0


def _check_untraceable(rank, world_size, argv, mode):
    import titan.planner.activations as activations
    from titan.plan.run_plan import plan_run
    from titan.planner.memory import check_fits
    from titan.planner.memory import plan_check as check_memory

    def untraceable(*args, **kwargs):
        raise NotImplementedError("aten::made_up_op has no fake-tensor kernel")

    activations.trace_activations = untraceable
    j = job(*argv, "--memory.check", mode)
    plan = plan_run(j, 2)
    problem = check_fits(j, plan)
    try:
        check_memory(j, plan)
        refused = None
    except ConfigError as e:
        refused = str(e)
    return problem, refused


@needs_fork
def test_untraced_activations_fail_the_memory_check(tmp_path):
    # 80 GiB: the debug model's states fit many times over; only the activations are unknown
    argv = ["--memory.device_memory_gib", "80"]
    problem, refused = run_workers(
        _check_untraceable, 1, tmp_path, argv, "error", init_pg=False, barrier=False
    )[0]
    assert problem is not None and refused is not None
    assert "activations could not be traced" in refused and "made_up_op" in refused
    assert "is unknown" in refused and "memory.check" in refused  # why, and the way on
    (tmp_path / "warn").mkdir()
    problem, refused = run_workers(
        _check_untraceable, 1, tmp_path / "warn", argv, "warn", init_pg=False, barrier=False
    )[0]
    assert "could not be traced" in problem and refused is None  # warn: launches anyway


# ----------------------------------------------------------------------------- reuse


def _pipeline_ranks(rank, world_size, argv, wide_blocks):
    """(the figures of every pipeline rank as the planner gives them, each rank's own
    figures built and traced alone, the ranks built)."""
    import titan.planner.memory as memory
    from titan.plan.run_plan import plan_run

    j = job(*argv)
    plan = plan_run(j, 4)
    if wide_blocks:  # a family whose blocks differ: these have a wider FFN
        plan = dataclasses.replace(plan, spec=_with_wide_blocks(plan.spec, wide_blocks))
    built = []
    figures = memory._rank_figures

    def counted(job_, plan_, rank_, *rest):
        built.append(rank_)
        return figures(job_, plan_, rank_, *rest)

    memory._rank_figures = counted
    planned = [b for _, _, b in memory.pipeline_rank_bytes(j, plan)]
    memory._rank_figures = figures
    alone = [memory.rank_bytes(j, plan, r) for r in range(4)]
    return planned, alone, built


def _with_wide_blocks(spec, blocks):
    from torch import nn

    base = spec.model_cls

    class WideBlocks(base):
        def __init__(self, args):
            super().__init__(args)
            for i in blocks:
                self.layers[str(i)].feed_forward = nn.Sequential(
                    nn.Linear(args.dim, 8 * args.dim, bias=False),
                    nn.Linear(8 * args.dim, args.dim, bias=False),
                )

    return dataclasses.replace(spec, model_cls=WideBlocks)


# stages of layers 0 | 1-2 | 3-4 | 5: pipeline ranks 1 and 2 hold 2 middle layers each
SPLIT = [
    "--parallelism.pipeline_parallel_degree",
    "4",
    "--training.local_batch_size",
    "8",
    "--parallelism.pipeline_parallel_split_points",
    "layers.1,layers.3,layers.5",
]


@needs_fork
def test_alike_stages_are_traced_once_and_walk_their_own_schedule(tmp_path):
    planned, alone, built = run_workers(
        _pipeline_ranks, 1, tmp_path, SPLIT, (), init_pg=False, barrier=False
    )[0]
    assert built == [0, 1, 3]  # rank 2's stage is rank 1's, shifted by two layers
    assert planned == alone
    # 1F1B: the second pipeline rank keeps one microbatch more in flight than the third
    assert planned[1]["activations_bytes"] > planned[2]["activations_bytes"]


@needs_fork
def test_stages_of_unlike_blocks_are_not_reused(tmp_path):
    planned, alone, built = run_workers(
        _pipeline_ranks, 1, tmp_path, SPLIT, (1, 2), init_pg=False, barrier=False
    )[0]
    assert built == [0, 1, 2, 3]  # same layer counts, other blocks
    assert planned == alone
    assert planned[1]["params_bytes"] > planned[2]["params_bytes"]


# ----------------------------------------------------------------------------- --suggest


def layout(**degrees):
    return {**dict.fromkeys(LAYOUT_FIELDS, 1), "cp_type": "ring", **degrees}


def test_a_suggested_hybrid_names_its_all_to_all_groups_and_plans():
    from titan.plan.run_plan import plan_run
    from titan.planner.layout_search import CP_A2A_FIELD, Candidate

    hybrid = settings(layout(cp=4, cp_type="hybrid", cp_a2a=2), "none", 1, 4)
    assert hybrid[CP_A2A_FIELD] == 2
    assert CP_A2A_FIELD not in settings(layout(cp=4, cp_type="alltoall"), "none", 1, 4)
    candidate = apply_settings(job("--training.seq_len", "64"), hybrid)
    plan = plan_run(candidate, 4)
    assert plan.dims.cp == 4 and candidate.parallelism.context_parallel_alltoall_degree == 2
    assert Candidate(hybrid, 1, 0, 0.0).layout["cp_a2a"] == 2
    assert "cp_a2a" not in Candidate(settings(layout(), "none", 1, 4), 1, 0, 0.0).layout


def test_suggested_settings_go_through_the_config_parser():
    base = job("--model.attn_mask_type", "block_causal")
    fields = settings(layout(dp_shard=2, tp=2), "selective", 4, 32)
    candidate = apply_settings(base, fields)
    assert candidate.parallelism.tensor_parallel_degree == 2
    assert {source_of(candidate, k) for k in fields} == {"--suggest"}
    assert source_of(base, "parallelism.tensor_parallel_degree") == "the default"  # a copy
    assert source_of(candidate, "model.attn_mask_type").startswith("command line")
    # the parser's cross-field checks: document positions need block-causal masks
    with pytest.raises(ConfigError, match='needs model.attn_mask_type = "block_causal"'):
        apply_settings(job(), {"model.document_positions": True})
    # and its field checks, naming the source
    with pytest.raises(ConfigError, match=r"'sometimes' \(from --suggest\)"):
        apply_settings(base, {"activation_checkpoint.mode": "sometimes"})


def test_byte_figures_never_read_zero_for_a_nonzero_size():
    from titan.planner.memory import human_bytes

    assert human_bytes(1024) == "1.0 KiB"  # once "0.0 MiB"
    assert human_bytes(5 * 2**20) == "5.0 MiB"
    assert human_bytes(3 * 2**30) == "3.000 GiB"
