"""The part of each sequence this rank holds under context parallelism, as attention that
torch's ring attention cannot run sees it: the positions of its own tokens and of every
rank's (`all_positions`, in rank order), so that any mask defined on positions (documents, a
sliding window, a sink's extra logit in every row's softmax) is applied exactly as on one
rank, while `attend` passes the keys and values round the ring
(titan.parallelisms.ring_attention). `gather` brings every rank's copy of a small tensor
(document ids) for the masks.

Torch's ring attention (titan.parallelisms.context_parallel) runs causal SDPA with the keys
moving round the ring; attention with other masks asks `active()` for this instead. Outside a
context-parallel step `active()` is None.

All-to-all context parallelism (DeepSpeed-Ulysses; `by_heads`) trades the sequence split for a
head split inside attention: `heads_in` sends each rank's tokens of head group r to rank r,
which then holds every token of its 1/cp of the heads, in sequence order, and attends as one
rank would (any mask, the common kernels: `plain_sdpa`); `heads_out` sends the outputs back.
The hybrid runs that inside groups of ranks (`group`) and, across them (`across`, `outer()`),
a ring of the groups' keys and values.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan.parallelisms.ring_attention import ring_masked_attention

_active: "SequenceShard | None" = None
# SDPA as torch defines it: torch's context_parallel replaces F.scaled_dot_product_attention
# with ring attention while it is active, which all-to-all attention (whole sequences) must not
# run
plain_sdpa = F.scaled_dot_product_attention
_c10d = torch.ops._c10d_functional


class SequenceShard:
    def __init__(
        self,
        group: dist.ProcessGroup,
        positions: torch.Tensor,
        by_heads: bool = False,
        across: dist.ProcessGroup | None = None,
    ):
        self.group = group
        self.positions = positions  # (local tokens,) int64: this rank's, in its order
        self.by_heads = by_heads  # all-to-all attention (Ulysses) rather than ring/gather
        # hybrid: the group that holds the rest of the sequence, one rank per all-to-all group
        self.across = across
        self._all: torch.Tensor | None = None
        self._order: torch.Tensor | None = None
        self._outer: SequenceShard | None = None

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

    def attend(self, q, k, v, mask: torch.Tensor, sinks=None, scale=None) -> torch.Tensor:
        """This rank's queries against every rank's keys and values, which go round the
        group's ring; `mask` bool over (this rank's queries, all_positions() keys)."""
        return ring_masked_attention(q, k, v, mask, self.group, sinks, scale)

    def order(self) -> torch.Tensor:
        """The gathered tokens' indices in sequence order (load balancing deals chunks out
        head and tail: rank order is not sequence order)."""
        if self._order is None:
            self._order = torch.argsort(self.all_positions())
        return self._order

    def unorder(self) -> torch.Tensor:
        """The inverse of order(): sequence order back to rank order."""
        return torch.argsort(self.order())

    def whole(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` along `dim`, in sequence order: the whole sequence's."""
        return self.gather(t, dim).index_select(dim, self.order())

    def heads_in(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local tokens, d) -> (batch, heads / cp, every token in sequence
        order, d): this rank's group of heads for the whole sequence."""
        b, h, s, d = t.shape
        cp = self.group.size()
        if h % cp:
            raise ValueError(f"all-to-all context parallelism: {h} heads on a rank, cp {cp}")
        sent = t.reshape(b, cp, h // cp, s, d).transpose(0, 1)
        got = _AllToAll.apply(sent, self.group)  # [r]: rank r's tokens of my heads
        whole = got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
        return whole.index_select(2, self.order())

    def heads_out(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of heads_in: (batch, heads / cp, every token, d) -> (batch, heads,
        local tokens, d)."""
        b, hl, seq, d = t.shape
        cp = self.group.size()
        # back to rank order: the inverse of order() (the group's positions need not be
        # 0 .. n-1: a hybrid group holds part of the sequence)
        ranked = t.index_select(2, self.unorder()).reshape(b, hl, cp, seq // cp, d)
        got = _AllToAll.apply(ranked.permute(2, 0, 1, 3, 4), self.group)  # [r]: head group r
        return got.transpose(0, 1).reshape(b, cp * hl, seq // cp, d)

    def outer(self) -> "SequenceShard | None":
        """Hybrid: after heads_in, this rank's tokens are its all-to-all group's (in sequence
        order); the shard of those across the groups, whose keys it gathers. None otherwise."""
        if self.across is None:
            return None
        if self._outer is None:
            mine = self.all_positions().index_select(0, self.order())
            self._outer = SequenceShard(self.across, mine)
        return self._outer

    def head_slice(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's group of a per-head tensor (heads on dim 0), e.g. attention sinks."""
        if t is None:
            return None
        n = t.shape[0] // self.group.size()
        return t.narrow(0, dist.get_rank(group=self.group) * n, n)


class _AllToAll(torch.autograd.Function):
    """Exchange of the first dim's cp blocks: block r to rank r, rank r's block for me into
    r. Its own inverse, so backward exchanges the gradient the same way; one synchronous
    collective each way (as _Gather). Forward's is one op of titan's (out of place), which
    selective activation checkpointing keeps rather than exchanging again in recompute
    (titan.parallelisms.activation_checkpoint); an op of its own, as expert parallelism's
    all-to-alls (which it does not keep) run the same functional collective."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange_blocks(t.contiguous(), group.group_name, group.size())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    """All-gather along `dim`; backward sums the gradient over the ranks and keeps this rank's
    part. Written here rather than torch.distributed.nn's all_gather, whose gloo backward
    receives into tensors shaped like the incoming gradient's strides (a transposed gradient,
    as attention's key gradient can be, came back scrambled) and runs a collective per rank.
    Both directions are one synchronous collective: two in flight on one gloo group corrupt
    memory now and then (scripts/gloo_overlap_check.py). Forward's is one op, as
    _AllToAll's."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.length = group, dim, t.shape[dim]
        n = group.size()
        gathered = _gather_blocks(t.contiguous(), group.group_name, n)
        # (n * t's first dim, ...) -> rank blocks concatenated along `dim`
        return gathered.view(n, *t.shape).movedim(0, dim).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(group=ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.length, ctx.length), None, None


@torch.library.custom_op("titan::cp_all_to_all", mutates_args=())
def _exchange_blocks(t: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """Block r of the first dim to rank r of the group; rank r's block for this rank in r."""
    blocks = [t.shape[0] // size] * size
    return _c10d.wait_tensor(_c10d.all_to_all_single(t, blocks, blocks, group_name))


@_exchange_blocks.register_fake
def _(t, group_name, size):
    return torch.empty_like(t)


@torch.library.custom_op("titan::cp_all_gather", mutates_args=())
def _gather_blocks(t: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """Every rank's `t`, concatenated along the first dim in rank order."""
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(t, size, group_name))


@_gather_blocks.register_fake
def _(t, group_name, size):
    return t.new_empty(size * t.shape[0], *t.shape[1:])


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
