"""Global gradient-norm clipping over plain and DTensor (sharded/replicated) gradients.

On CPU the norm is a float64 sum of squares: torch's float32 CPU norm kernel accumulates
sequentially and is off by up to 1e-4 relative on a 0.5M-element gradient (the debug model's
embedding), by a different amount for each way the gradient is split, so one rank and FSDP
clipped by different factors. Float8 turns that last-digit difference into whole float8 steps.
GPU reductions are trees, accurate to float32 rounding: there torch's foreach norm is kept.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

# elements squared at a time: keeps the float32 temporary small whatever the gradient's size
_CHUNK = 1 << 18


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    extra_group: dist.ProcessGroup | None = None,
    uncounted: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip to `max_norm` (0 = measure only) and return the total 2-norm as a plain tensor.

    DTensor norms are reduced over their own mesh; `extra_group` sums squared norms over
    ranks that hold disjoint parameters (pipeline stages). `uncounted` are clipped but not
    counted: copies of a parameter counted elsewhere (a tied weight's pipeline copy).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if grads and grads[0].device.type == "cpu":
        total = _sum_of_squares(grads).sqrt().float()
    else:
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
    if extra_group is not None:
        sq = total.double().pow(2)
        dist.all_reduce(sq, group=extra_group)
        total = sq.sqrt().to(total.dtype)
    if max_norm > 0:
        params += [p for p in uncounted if p.grad is not None]
        # foreach kernels take one device mesh at a time (expert parallelism adds one)
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def _local_sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in flat.split(_CHUNK):
        total += chunk.float().pow(2).sum(dtype=torch.float64)
    return total


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of squares of all gradients, each counted once over its mesh."""
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    by_layout: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor):
            total += _local_sum_of_squares(g)
            continue
        if any(p.is_partial() for p in g.placements):  # a pending sum: squares do not add up
            g = g.redistribute(
                g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements]
            )
        by_layout.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
    for (mesh, placements), group in by_layout.items():
        part = sum(
            (_local_sum_of_squares(g.to_local()) for g in group),
            torch.zeros((), dtype=torch.float64, device=total.device),
        )
        # shards hold disjoint pieces: their squares add over the dims they are sharded on
        for dim, placement in enumerate(placements):
            # not is_shard(): FSDP over TP shards with _StridedShard, for which it is False
            if not placement.is_replicate() and mesh.size(dim) > 1:
                dist.all_reduce(part, group=mesh.get_group(dim))
        total += part
    return total
