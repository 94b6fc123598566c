"""The part of each sequence this rank holds under context parallelism, as attention that ring
attention cannot run sees it: the positions of its own tokens, and every rank's keys and
values gathered (all-gather forward, their gradients summed back to the ranks that made them
in backward) with their positions, so that any mask defined on positions (a sliding window,
a sink's extra logit in every row's softmax) is applied exactly as on one rank.

Ring attention (titan.parallelisms.context_parallel) runs causal SDPA with the keys moving
round the ring; attention with other masks asks `active()` for this instead: Llama 3's
all-gather form of context parallelism, K and V whole on every rank for the layer's duration.
Outside a context-parallel step `active()` is None.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_active: "SequenceShard | None" = None


class SequenceShard:
    def __init__(self, group: dist.ProcessGroup, positions: torch.Tensor):
        self.group = group
        self.positions = positions  # (local tokens,) int64: this rank's, in its order
        self._all: torch.Tensor | None = None

    def all_positions(self) -> torch.Tensor:
        """The positions of the gathered keys, every rank's in rank order."""
        if self._all is None:
            parts = [torch.empty_like(self.positions) for _ in range(self.group.size())]
            dist.all_gather(parts, self.positions.contiguous(), group=self.group)
            self._all = torch.cat(parts)
        return self._all

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t`, concatenated along its sequence dim `dim` in rank order."""
        return _Gather.apply(t, self.group, dim)


class _Gather(torch.autograd.Function):
    """All-gather along `dim`; backward sums the gradient over the ranks and keeps this rank's
    part. Written here rather than torch.distributed.nn's all_gather, whose gloo backward
    receives into tensors shaped like the incoming gradient's strides (a transposed gradient,
    as attention's key gradient can be, came back scrambled) and runs a collective per rank.
    Both directions are one synchronous collective: two in flight on one gloo group corrupt
    memory now and then (scripts/gloo_overlap_check.py)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.length = group, dim, t.shape[dim]
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(group.size())]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(group=ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.length, ctx.length), None, None


def active() -> SequenceShard | None:
    return _active


@contextlib.contextmanager
def activated(shard: SequenceShard) -> Iterator[None]:
    global _active
    outer, _active = _active, shard
    try:
        yield
    finally:
        _active = outer
