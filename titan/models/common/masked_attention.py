"""Attention written out, for what SDPA cannot run: a bool mask under context parallelism
(where torch makes SDPA ring attention), learned per-head sinks.

One op (`titan::masked_attention`) whose backward recomputes the probabilities from q and k:
between forward and backward it keeps its inputs and nothing of the score matrix's size (the
ops written out kept the probabilities: queries x keys per head, per layer), and selective
activation checkpointing keeps its output as one op rather than redo it in recompute
(titan.parallelisms.activation_checkpoint). Queries go in blocks, so the transient scores
stay bounded too. Each block's arithmetic is the written-out form's: softmax over the masked
scores in the inputs' dtype, then the values.
"""

import torch
from torch import Tensor

from titan.parallelisms.ring_attention import expanded, folded

_BLOCK_SCORES = 1 << 24  # scores a block of queries holds at once: 64 MiB in fp32


def masked_attention(q, k, v, mask: Tensor, sinks=None, scale=None) -> Tensor:
    """Softmax over each row's scores (and, with `sinks`, its head's sink logit, whose share
    is dropped), then the values: q (b, h, s, d); k (b, kv_heads, t, d); v (b, kv_heads, t,
    dv); mask bool, broadcastable to (b, h, s, t); `scale` default 1/sqrt(d)."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _masked_attention(q, k, v, mask, sinks, scale)


def _rows(q: Tensor, keys: int) -> int:
    return max(1, _BLOCK_SCORES // max(1, q.shape[0] * q.shape[1] * keys))


def _probs(qb, kx, mask_b, sinks, scale) -> Tensor:
    """(b, h, rows, t) probabilities of a block of queries; with sinks, the sink's column
    last (its share of each row)."""
    scores = (qb @ kx.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask_b, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)


@torch.library.custom_op("titan::masked_attention", mutates_args=())
def _masked_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor | None, scale: float
) -> Tensor:
    kx, vx = expanded(k, q.shape[1]), expanded(v, q.shape[1])
    step = _rows(q, k.shape[2])
    out = []
    for r in range(0, q.shape[2], step):
        rows = slice(r, r + step)
        mask_b = mask[:, :, rows] if mask.shape[2] > 1 else mask
        probs = _probs(q[:, :, rows], kx, mask_b, sinks, scale)
        if sinks is not None:
            probs = probs[..., :-1]
        out.append(probs.to(v.dtype) @ vx)
    return torch.cat(out, dim=2)


@_masked_attention.register_fake
def _(q, k, v, mask, sinks, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _setup(ctx, inputs, output):
    q, k, v, mask, sinks, scale = inputs
    ctx.save_for_backward(q, k, v, mask, sinks)
    ctx.scale = scale


def _backward(ctx, grad):
    """Softmax's gradient from the recomputed probabilities P, block by block: dP = dO V^T,
    dS = P (dP - rowsum(P dP)); a sink (value zero) takes -P_sink rowsum(P dP)."""
    q, k, v, mask, sinks = ctx.saved_tensors
    heads = q.shape[1]
    kx, vx = expanded(k, heads), expanded(v, heads)
    dq = torch.empty_like(q)
    dkx, dvx = torch.zeros_like(kx), torch.zeros_like(vx)
    acc = torch.promote_types(q.dtype, torch.float32)  # a sink's gradient sums many rows
    dsinks = None if sinks is None else torch.zeros(heads, dtype=acc, device=q.device)
    step = _rows(q, k.shape[2])
    for r in range(0, q.shape[2], step):
        rows = slice(r, r + step)
        qb, do = q[:, :, rows], grad[:, :, rows]
        mask_b = mask[:, :, rows] if mask.shape[2] > 1 else mask
        probs = _probs(qb, kx, mask_b, sinks, ctx.scale)
        p = probs[..., :-1] if sinks is not None else probs
        dvx += p.to(v.dtype).transpose(-2, -1) @ do
        dp = (do @ vx.transpose(-2, -1)).to(p.dtype)
        rowsum = (p * dp).sum(dim=-1, keepdim=True)
        ds = p * (dp - rowsum)
        dq[:, :, rows] = (ds @ kx.to(ds.dtype)).to(q.dtype) * ctx.scale
        dkx += (ds.transpose(-2, -1) @ qb.to(ds.dtype)).to(k.dtype) * ctx.scale
        if sinks is not None:
            dsinks -= (probs[..., -1:] * rowsum).sum(dim=(0, 2, 3)).to(acc)

    dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    return dq, folded(dkx, k.shape[1]), folded(dvx, k.shape[1]), None, dsinks, None


_masked_attention.register_autograd(_backward, setup_context=_setup)
