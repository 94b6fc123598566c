"""Auxiliary losses (an MoE router's load-balancing loss, say): a model adds them to what
backward differentiates without changing its outputs, so `loss` stays the cross-entropy that
compares with other frameworks.

A model calls `attach_aux_loss(hidden, name, value)` in forward and carries on with what it
returns: the same values, whose backward also sends a gradient into `value`. Riding on an
activation, the extra gradient reaches the stage that made it under pipeline parallelism too.
The trainer opens an `AuxLossCollector` around a step's forward/backward: it sets the weight of
one microbatch (so the step minimizes cross-entropy + the mean of each aux loss over the
microbatches) and keeps the values for logging. Outside one (validation, generation, the
memory planner), nothing is attached.
"""

import contextlib

import torch

_active: "AuxLossCollector | None" = None


class AuxLossCollector:
    def __init__(self, microbatch_weight: float):
        self.weight = microbatch_weight
        self.values: dict[str, torch.Tensor] = {}  # the step's weighted sums, detached

    def __enter__(self) -> "AuxLossCollector":
        global _active
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._outer

    def add(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().float() * self.weight
        self.values[name] = self.values[name] + v if name in self.values else v

    def floats(self) -> dict[str, float]:
        return {name: _local(v).item() for name, v in self.values.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class _AddGradOf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, value, weight):
        ctx.weight = weight
        ctx.save_for_backward(value)  # a scalar; full_like keeps its kind (a DTensor under TP)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        value, = ctx.saved_tensors
        return grad, torch.full_like(value, ctx.weight), None


def attach_aux_loss(out: torch.Tensor, name: str, value: torch.Tensor) -> torch.Tensor:
    """`out` unchanged; within a collected training step, backward also differentiates
    `value` (a scalar), weighted like one microbatch's share of the step."""
    collector = _active
    if collector is None or not torch.is_grad_enabled():
        return out
    collector.add(name, value)
    return _AddGradOf.apply(out, value, collector.weight)


def collecting() -> bool:
    """Whether an aux loss computed now would be attached (to skip computing it otherwise)."""
    return _active is not None and torch.is_grad_enabled()


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


def reduce_aux_losses(values: dict[str, float], pp_degree: int) -> dict[str, float]:
    """Every rank's step values -> the run's: summed over pipeline stages (each holds its own
    layers' losses), averaged over the other ranks. Collective (all ranks call it)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    total: dict[str, float] = {}
    for rank_values in every:
        for name, v in rank_values.items():
            total[name] = total.get(name, 0.0) + v
    share = dist.get_world_size() // pp_degree
    return {name: v / share for name, v in sorted(total.items())}
