"""Pipeline parallelism: plan the stages (layer ranges, placement, microbatches) and build the
schedule. Cutting a stage out of a model is the model family's `pipelining_fn`.
"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan.config.manager import did_you_mean

SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# the schedules that run several stages per rank (torch's PipelineScheduleMulti); spelled out
# so that planning does not import torch.distributed.pipelining (over a second, paid by the
# launcher's config check); a unit test holds it to torch's classes
MULTI_STAGE = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


class PipelineConfigError(ValueError):
    pass


def is_multi_stage(schedule: str) -> bool:
    return schedule in MULTI_STAGE


def stage_layer_ranges(
    n_layers: int, num_stages: int, split_points: list[int], layer_costs: list[int] | None = None
) -> list[range]:
    """Contiguous layer ranges per stage: at `split_points` (first layer of each stage after the
    first) if given; else, for layers of unequal `layer_costs`, the split whose costliest stage
    costs least; else as even as possible with earlier stages taking the remainder."""
    if split_points:
        bounds = [0, *split_points, n_layers]
        if len(bounds) - 1 != num_stages or bounds != sorted(set(bounds)):
            raise PipelineConfigError(
                f"pipeline_parallel_split_points {split_points} must be {num_stages - 1} "
                f"increasing layer indices in (0, {n_layers}) to give {num_stages} stages"
            )
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    if num_stages > n_layers:
        raise PipelineConfigError(
            f"{num_stages} pipeline stages exceed the model's {n_layers} layers"
        )
    if layer_costs is not None and len(set(layer_costs)) > 1:
        return balanced_layer_ranges(layer_costs, num_stages)
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def balanced_layer_ranges(costs: list[int], num_stages: int) -> list[range]:
    """Contiguous, non-empty stages over layers of these costs, minimizing the costliest stage
    (dynamic programming over split points); among equal splits, earlier stages take more."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the least possible costliest stage when k stages hold layers [0, i)
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst <= best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds, i = [n], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    num_stages: int
    stage_ids: tuple[int, ...]  # stages held by this pp rank
    layer_ranges: tuple[range, ...]  # per stage, over all stages
    n_microbatches: int


def plan_pipelines(
    cfg, *, n_layers: int, local_batch_size: int, layer_costs: list[int] | None = None
) -> tuple[PipelinePlan, ...]:
    """The stages of `cfg` (the parallelism section) for a model of `n_layers` layers (of
    `layer_costs`, if they differ), as seen by each pipeline rank (index: pp rank), for
    batches of `local_batch_size` sequences."""
    pp, schedule = cfg.pipeline_parallel_degree, cfg.pipeline_parallel_schedule
    microbatch_size = cfg.pipeline_parallel_microbatch_size
    layers_per_stage = cfg.pipeline_parallel_layers_per_stage
    split_points = cfg.pipeline_parallel_split_points
    if schedule not in SCHEDULES:
        raise PipelineConfigError(
            f"unknown pipeline_parallel_schedule {schedule!r}; choose one of "
            f"{', '.join(SCHEDULES)}{did_you_mean(schedule, list(SCHEDULES))}"
        )
    multi = is_multi_stage(schedule)
    if split_points:
        points = [_layer_index(p) for p in split_points]
        num_stages = len(points) + 1
    elif layers_per_stage:
        points = []
        num_stages = math.ceil(n_layers / layers_per_stage)
    else:
        points = []
        num_stages = pp * (2 if multi else 1)
    if num_stages % pp:
        raise PipelineConfigError(
            f"{num_stages} pipeline stages do not divide evenly over pipeline_parallel_degree {pp}"
        )
    per_rank = num_stages // pp
    if not multi and per_rank != 1:
        raise PipelineConfigError(
            f"schedule {schedule} runs one stage per rank, but the split gives {per_rank}; "
            "use a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
            "ZBVZeroBubble, DualPipeV) or fewer stages"
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise PipelineConfigError(f"{schedule} needs exactly 2 stages per rank, got {per_rank}")
    if local_batch_size % microbatch_size:
        raise PipelineConfigError(
            f"local_batch_size {local_batch_size} is not divisible by "
            f"pipeline_parallel_microbatch_size {microbatch_size}"
        )
    n_micro = local_batch_size // microbatch_size
    if n_micro < pp:
        raise PipelineConfigError(
            f"{n_micro} microbatches (local_batch_size {local_batch_size} / microbatch size "
            f"{microbatch_size}) cannot fill {pp} pipeline ranks; need at least {pp}"
        )
    if schedule in V_SCHEDULES and n_micro < num_stages:
        raise PipelineConfigError(
            f"{schedule} needs at least as many microbatches as stages ({num_stages}), "
            f"got {n_micro}"
        )
    ranges = tuple(
        stage_layer_ranges(n_layers, num_stages, points, None if layers_per_stage else layer_costs)
    )
    return tuple(
        PipelinePlan(
            schedule, num_stages, _stage_ids(schedule, num_stages, pp, pp_rank), ranges, n_micro
        )
        for pp_rank in range(pp)
    )


def _stage_ids(schedule: str, num_stages: int, pp: int, pp_rank: int) -> tuple[int, ...]:
    if schedule in V_SCHEDULES:
        # V placement: rank r holds stage r on the way down and 2*pp-1-r on the way back
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(range(pp_rank, num_stages, pp))


def _layer_index(point: str) -> int:
    name = point.removeprefix("layers.")
    if not name.isdigit():
        raise PipelineConfigError(f"split point {point!r} must name a layer, e.g. 'layers.4'")
    return int(name)


def _stage_class(inference_ctx: Callable):
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        """A stage whose first step's shape inference (a forward and backward on empty
        tensors) runs inside `inference_ctx` (so that, e.g., no auxiliary loss is recorded)."""

        def _prepare_forward_infra(self, *args, **kwargs):
            with inference_ctx():
                return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args, **kwargs):
            with inference_ctx():
                return super()._prepare_backward_infra(*args, **kwargs)

        # called before each weight backward (W), while what its input-only backward kept
        # is still reachable (torch takes it out of the stage's state first): the first
        # step's memory measurement
        before_weight_backward: Callable | None = None

        def backward_weight_one_chunk(self, *args, **kwargs):
            if self.before_weight_backward is not None:
                self.before_weight_backward()
            return super().backward_weight_one_chunk(*args, **kwargs)

    return Stage


def build_schedule(
    stages: list[nn.Module],
    plan: PipelinePlan,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable,
    inference_ctx: Callable = contextlib.nullcontext,
):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    pipeline_stages = [
        _stage_class(inference_ctx)(m, sid, plan.num_stages, device, group=pp_mesh.get_group())
        for m, sid in zip(stages, plan.stage_ids)
    ]
    cls = get_schedule_class(plan.schedule)
    # the loss is already normalized over every token of the step: no extra scaling
    if issubclass(cls, PipelineScheduleSingle):
        return cls(
            pipeline_stages[0],
            n_microbatches=plan.n_microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )
    return cls(
        pipeline_stages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False
    )


def schedule_stages(schedule) -> list:
    """This rank's stages of a schedule: a multi-stage one's list, or a single one's."""
    return getattr(schedule, "_stages", None) or [schedule._stage]


def held_between_actions(schedule) -> list[torch.Tensor]:
    """Tensors a schedule's stages hold between actions that a backward made, so that no
    forward did: the gradients an input-only backward keeps for the weight backward (at the
    intermediates it starts from) and leaves on its inputs (`.grad`, until the next step),
    and the receive buffers a V schedule's same-rank stages replace with each other's tensors.
    The memory measurement counts them (titan.components.observability.memory_measure)."""
    from torch.utils._pytree import tree_leaves

    held = []
    for stage in schedule_stages(schedule):
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            for info in infos:
                if info.buffer is not None:
                    held += [info.buffer, info.buffer.grad]
        held += tree_leaves(list(stage.bwd_cache.values()))
        for inputs, param_groups, _, output_grads in stage.backward_state.values():
            groups = [g.get("grads") for g in param_groups or ()]
            held += tree_leaves([inputs, [getattr(t, "grad", None) for t in inputs], groups])
            held += tree_leaves(output_grads)
    return [t for t in held if isinstance(t, torch.Tensor)]
