"""Ring attention with any mask defined on positions (documents, windows, sinks), for context
parallelism where torch's ring attention (causal SDPA only) cannot go.

Each rank keeps its queries; the keys and values go round the ring, one rank's block a step,
so no rank ever holds more than two blocks of them (its own and the one passing through).
A block's scores against this rank's queries are masked by the columns of the bool mask
that belong to that block's rank (the mask's keys are in rank order, as
SequenceShard.all_positions gives them), folded into a running softmax (max, sum, weighted
values), and a head's sink joins the sum at the end. Backward goes round again with the
saved log-sum-exp: each block's key and value gradients travel with the block and arrive
home after the last step. Each move is one synchronous collective (an all-to-all in which a
rank sends only to the next): two in flight on one gloo group are not safe
(scripts/gloo_overlap_check.py).

One op (`titan::ring_masked_attention`), so selective activation checkpointing keeps its
output instead of going round the ring again in recompute. The work goes in tiles of at most
256 queries x 256 keys, and a tile the mask hides whole is skipped: causal masks skip about
half, document masks of short documents most (the all-gather form computed every score).
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group


def ring_masked_attention(q, k, v, mask: Tensor, group, sinks=None, scale=None) -> Tensor:
    """q (b, h, s, d): this rank's queries; k (b, kv_heads, t, d), v (b, kv_heads, t, dv):
    its keys and values; mask bool broadcastable to (b, h, s, group size x t), its columns
    every rank's keys in rank order; sinks (h,) or None."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = _ring_attention(q, k, v, mask, sinks, scale, group.group_name)
    return out


def _shift(tensors: list[Tensor], group) -> list[Tensor]:
    """Send `tensors` to the next rank of the ring; return the previous rank's. One
    collective of their bytes, each tensor keeping its dtype (K/V in the inputs' dtype, their
    gradients in float32)."""
    n, rank = group.size(), dist.get_rank(group)
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    send, recv = [0] * n, [0] * n
    send[(rank + 1) % n] = recv[(rank - 1) % n] = flat.numel()
    got = torch.empty_like(flat)
    dist.all_to_all_single(got, flat, recv, send, group=group)
    out, at = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        out.append(got[at : at + size].view(t.dtype).view(t.shape))
        at += size
    return out


_TILE = 256  # queries and keys a side of a tile, at most (documents skip most tiles)
_TILE_SCORES = 1 << 24  # and at most this many scores (batch x heads x queries x keys)


def expanded(t: Tensor, heads: int) -> Tensor:
    """kv heads (dim 1) repeated to the query heads (GQA)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def folded(t: Tensor, kv_heads: int) -> Tensor:
    """The inverse for gradients: a repeated kv head's gradient, the sum over its query
    heads."""
    b, h, t_len, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, t_len, d).sum(dim=2)


def _tiles(q: Tensor, t: int, mask: Tensor, src: int):
    """(query rows, key columns of the block, the tile's mask) of the tiles of this rank's
    queries against rank src's block of t keys that any query sees: a tile the mask hides
    whole (causal: later keys; documents: other documents) is skipped."""
    cols_step = min(t, _TILE)
    rows_step = max(1, min(_TILE, _TILE_SCORES // (q.shape[0] * q.shape[1] * cols_step)))
    for r in range(0, q.shape[2], rows_step):
        rows = slice(r, r + rows_step)
        m_rows = mask[:, :, rows] if mask.shape[2] > 1 else mask
        for c in range(0, t, cols_step):
            cols = slice(c, c + cols_step)
            m = m_rows[..., src * t + c : src * t + min(c + cols_step, t)]
            if m.any():
                yield rows, cols, m


@torch.library.custom_op("titan::ring_masked_attention", mutates_args=())
def _ring_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor | None, scale: float, group: str
) -> tuple[Tensor, Tensor]:
    pg = _resolve_process_group(group)
    n, rank = pg.size(), dist.get_rank(pg)
    b, h, s, _ = q.shape
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    run_max = torch.full((b, h, s, 1), float("-inf"), dtype=acc_dtype, device=q.device)
    run_sum = torch.zeros((b, h, s, 1), dtype=acc_dtype, device=q.device)
    acc = torch.zeros((b, h, s, v.shape[-1]), dtype=acc_dtype, device=q.device)
    k_blk, v_blk = k.contiguous(), v.contiguous()
    for i in range(n):
        kx, vx = expanded(k_blk, h), expanded(v_blk, h)
        for rows, cols, m in _tiles(q, k.shape[2], mask, (rank - i) % n):
            scores = ((q[:, :, rows] @ kx[:, :, cols].transpose(-2, -1)) * scale).to(acc_dtype)
            scores = scores.masked_fill(~m, float("-inf"))
            new_max = torch.maximum(run_max[:, :, rows], scores.amax(dim=-1, keepdim=True))
            safe = new_max.masked_fill(new_max == float("-inf"), 0.0)
            e = torch.exp(scores - safe)
            keep = torch.exp(run_max[:, :, rows] - safe)
            run_sum[:, :, rows] = run_sum[:, :, rows] * keep + e.sum(dim=-1, keepdim=True)
            acc[:, :, rows] = acc[:, :, rows] * keep + (e.to(v.dtype) @ vx[:, :, cols]).to(
                acc_dtype
            )
            run_max[:, :, rows] = new_max
        if i < n - 1:
            k_blk, v_blk = _shift([k_blk, v_blk], pg)
    if sinks is not None:
        sink = sinks.to(acc_dtype)[None, :, None, None]
        new_max = torch.maximum(run_max, sink)
        run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(sink - new_max)
        acc = acc * torch.exp(run_max - new_max)
        run_max = new_max
    lse = (run_max + torch.log(run_sum)).squeeze(-1)
    return (acc / run_sum).to(q.dtype), lse


@_ring_attention.register_fake
def _(q, k, v, mask, sinks, scale, group):
    b, h, s, _ = q.shape
    out = q.new_empty(b, h, s, v.shape[-1])
    return out, q.new_empty(b, h, s, dtype=torch.promote_types(q.dtype, torch.float32))


def _setup(ctx, inputs, output):
    q, k, v, mask, sinks, scale, group = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, sinks, out, lse)
    ctx.scale, ctx.group = scale, group


def _backward(ctx, grad_out, _grad_lse):
    """P = exp(scores - lse) block by block; dS = P (dP - rowsum(dO O)); a sink (value zero)
    takes -P_sink rowsum(dO O). Each block's dK, dV ride round the ring with it."""
    q, k, v, mask, sinks, out, lse = ctx.saved_tensors
    pg = _resolve_process_group(ctx.group)
    n, rank = pg.size(), dist.get_rank(pg)
    h = q.shape[1]
    acc_dtype = lse.dtype
    delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1, keepdim=True)
    lse4 = lse[..., None]
    dq = torch.zeros_like(q, dtype=acc_dtype)
    k_blk, v_blk = k.contiguous(), v.contiguous()
    dk_blk = torch.zeros_like(k, dtype=acc_dtype)
    dv_blk = torch.zeros_like(v, dtype=acc_dtype)

    for i in range(n):
        kx, vx = expanded(k_blk, h).to(acc_dtype), expanded(v_blk, h).to(acc_dtype)
        dkx, dvx = torch.zeros_like(kx), torch.zeros_like(vx)
        for rows, cols, m in _tiles(q, k.shape[2], mask, (rank - i) % n):
            qb, do = q[:, :, rows].to(acc_dtype), grad_out[:, :, rows].to(acc_dtype)
            kt, vt = kx[:, :, cols], vx[:, :, cols]
            scores = (qb @ kt.transpose(-2, -1)) * ctx.scale
            p = torch.exp(scores.masked_fill(~m, float("-inf")) - lse4[:, :, rows])
            dvx[:, :, cols] += p.transpose(-2, -1) @ do
            ds = p * (do @ vt.transpose(-2, -1) - delta[:, :, rows])
            dq[:, :, rows] += (ds @ kt) * ctx.scale
            dkx[:, :, cols] += (ds.transpose(-2, -1) @ qb) * ctx.scale
        dk_blk, dv_blk = dk_blk + folded(dkx, k.shape[1]), dv_blk + folded(dvx, k.shape[1])
        if i < n - 1:
            k_blk, v_blk, dk_blk, dv_blk = _shift([k_blk, v_blk, dk_blk, dv_blk], pg)
    if n > 1:  # the gradients of the block last held belong to the next rank
        dk_blk, dv_blk = _shift([dk_blk, dv_blk], pg)
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.to(acc_dtype)[None, :, None, None] - lse4)
        dsinks = -(p_sink * delta).sum(dim=(0, 2, 3)).to(sinks.dtype)
    return (
        dq.to(q.dtype),
        dk_blk.to(k.dtype),
        dv_blk.to(v.dtype),
        None,
        dsinks,
        None,
        None,
    )


_ring_attention.register_autograd(_backward, setup_context=_setup)
