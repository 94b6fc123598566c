"""Auxiliary losses (an MoE router's load-balancing loss, say): a model adds them to what
backward differentiates without changing its outputs, so `loss` stays the cross-entropy that
compares with other frameworks.

A model calls `attach_aux_loss` or `attach_group_loss` in forward and carries on with what it
returns: the same values, whose backward also sends a gradient into the loss. Riding on an
activation, the extra gradient reaches the stage that made it under pipeline parallelism too.
The trainer opens an `AuxLossCollector` around a step's forward/backward and keeps the values
for logging. Outside one (validation, generation, the memory planner), nothing is attached.

Two kinds, so that no layout changes what is trained:
- `attach_aux_loss`: a mean over the microbatch's tokens; the step minimizes the mean over its
  microbatches (each weighted alike: they hold equal token counts).
- `attach_group_loss`: a loss defined on groups of tokens that a layout may split (a sequence,
  the global batch), such as a balancing loss built from routing counts. The model asks the
  collector's `TokenSplit` for the sums it needs over the ranks that hold the group's other
  tokens, computes this rank's share of each group's loss, and the step minimizes the mean over
  the step's groups: the same objective and gradient on every layout.
"""

import contextlib

import torch

from titan.parallelisms.token_split import TokenSplit

_active: "AuxLossCollector | None" = None


# one process's split (nothing split, nothing averaged); frozen, so one instance serves all
ONE_PROCESS = TokenSplit()


class AuxLossCollector:
    def __init__(self, microbatch_weight: float, split: TokenSplit = ONE_PROCESS):
        self.weight = microbatch_weight
        self.split = split
        # the step's values, detached, each rank's share of the run's: summed over all ranks
        # by reduce_aux_losses
        self.values: dict[str, torch.Tensor] = {}

    def __enter__(self) -> "AuxLossCollector":
        global _active
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._outer

    def add(self, name: str, value: torch.Tensor, share: float) -> None:
        if _recomputing():  # activation checkpointing runs the forward again in backward
            return
        v = value.detach().float() * share
        self.values[name] = self.values[name] + v if name in self.values else v

    def floats(self) -> dict[str, float]:
        return {name: _local(v).item() for name, v in self.values.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _recomputing() -> bool:
    # a compiled block's recompute runs inside its backward graph, which replays no Python:
    # only eager recomputes reach here (and torch.compile cannot trace the task id)
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class _AddGradOf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, value, weight):
        ctx.weight = weight
        ctx.save_for_backward(value)  # a scalar; full_like keeps its kind (a DTensor under TP)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        return grad, torch.full_like(value, ctx.weight), None


def attach_aux_loss(
    out: torch.Tensor, name: str, value: torch.Tensor, weight: float = 1.0
) -> torch.Tensor:
    """`out` unchanged; within a collected training step, backward also differentiates
    `weight` x `value` (a scalar: a mean over this microbatch's tokens), weighted like one
    microbatch's share of the step; `value` is logged as `name`, without `weight`."""
    collector = _active
    if collector is None or not torch.is_grad_enabled():
        return out
    collector.add(name, value, collector.weight / collector.split.stage_ranks)
    return _AddGradOf.apply(out, value, collector.weight * weight)


def attach_group_loss(
    out: torch.Tensor, name: str, value: torch.Tensor, groups: int
) -> torch.Tensor:
    """`out` unchanged; within a collected training step, the step's objective gains the mean
    over its `groups` token groups of a per-group loss. `value` (a scalar) is this rank's
    share of the sum over the groups it holds tokens of: the ranks' shares of a group add up to
    its loss (computed with `token_split()`'s sums)."""
    collector = _active
    if collector is None or not torch.is_grad_enabled():
        return out
    split = collector.split
    collector.add(name, value, 1 / (groups * split.replicas))
    return _AddGradOf.apply(out, value, split.grad_scale / groups)


def token_split() -> TokenSplit:
    """The running step's token split (one process's outside a step)."""
    return _active.split if _active is not None else TokenSplit()


def collecting() -> bool:
    """Whether an aux loss computed now would be attached (to skip computing it otherwise)."""
    return _active is not None and torch.is_grad_enabled()


def first_forward_of_step() -> bool:
    """A training step's forward, met once: not validation, generation, a pipeline stage's
    shape inference (all outside a collector) nor activation checkpointing's eager
    recompute. Where a model gathers a step's statistics (its heads' largest logits)."""
    return collecting() and not _recomputing()


@contextlib.contextmanager
def paused():
    """No aux loss is attached within (a pipeline stage's shape inference, which runs the
    model on empty tensors)."""
    global _active
    outer, _active = _active, None
    try:
        yield
    finally:
        _active = outer


def reduce_aux_losses(values: dict[str, float]) -> dict[str, float]:
    """Every rank's share of the step's values -> the run's: their sum over all ranks
    (pipeline stages each add their own layers'). Collective (all ranks call it)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    total: dict[str, float] = {}
    for rank_values in every:
        for name, v in rank_values.items():
            total[name] = total.get(name, 0.0) + v
    return dict(sorted(total.items()))
