"""Weights a model ties (one parameter under two names, e.g. the embedding and the output
projection) that pipeline parallelism splits across stages: each stage holds a copy, the
gradients of the copies are summed before the optimizer step, so the copies stay equal and
train exactly as the one parameter of an unsplit model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    # under no_grad, to_local() is the shard itself: writing to it writes the gradient
    return t.to_local() if isinstance(t, DTensor) else t


class TiedCopies:
    """The copies of tied parameters on this rank's pipeline stages.

    `ties` are (owner name, copy name) pairs of the whole model; the owner lives on the first
    stage, the copy on a later one. With both on this rank (V schedules) the gradients add
    locally; otherwise the first and last pipeline rank of each (dp, cp, tp) coordinate
    all-reduce them in a group of two. Their gradients must be in their parameters' own
    sharding (`tensor_parallel.shard_grads_like_params`), so the local shards match.
    """

    def __init__(
        self,
        parts: list[nn.Module],
        ties: list[tuple[str, str]],
        world_mesh: DeviceMesh,
        split: bool,
    ):
        params = {name: p for part in parts for name, p in part.named_parameters()}
        self.pairs = [(params.get(a), params.get(b)) for a, b in ties]
        # `split`: the first and last stage are on different ranks (the same answer on all)
        self.group = self._pair_group(world_mesh) if split else None

    @staticmethod
    def _pair_group(world_mesh: DeviceMesh):
        # new_group is collective over the world: every rank creates every pair, keeps its own
        ranks = world_mesh.mesh.reshape(world_mesh.mesh.shape[0], -1)
        mine = None
        for j in range(ranks.shape[1]):
            pair = [int(ranks[0, j]), int(ranks[-1, j])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
        return mine

    @torch.no_grad()
    def sum_grads(self) -> None:
        for owner, copy in self.pairs:
            held = [p for p in (owner, copy) if p is not None and p.grad is not None]
            if not held:
                continue
            total = _local(held[0].grad)
            for p in held[1:]:
                total.add_(_local(p.grad))
            if self.group is not None and len(held) == 1:  # the other copy is on the pair rank
                dist.all_reduce(total, group=self.group)
            for p in held[1:]:
                _local(p.grad).copy_(total)

    def split(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(`params` without the copies, the copies): a gradient norm counts each weight once."""
        copies = {id(c) for _, c in self.pairs if c is not None}
        return ([p for p in params if id(p) not in copies], [p for p in params if id(p) in copies])
