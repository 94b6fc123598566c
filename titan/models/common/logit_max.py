"""Each attention head's largest pre-softmax logit (scale x q.k) over the query/key pairs its
mask lets attend: what QK-clip (Kimi K2's MuonClip) bounds. An attention module that is asked
to (`track_logit_max`) keeps the running maximum of its heads in a buffer over a step's
forwards; whoever reads it resets it. Computed apart from the attention kernel (which keeps no
scores), without gradients, a block of queries at a time."""

import torch

# scores computed at once (batch x heads x queries x keys) in a block of queries: on the CPU
# small enough to be reused by the allocator (a fresh large block costs its page faults, more
# than the product itself); on a GPU few enough blocks for torch.compile, which unrolls them
BLOCK_SCORES = {"cpu": 1 << 20, "cuda": 1 << 27}


def allowed_pairs(mask, lo: int, hi: int, keys: int, device, window: int | None = None):
    """Where queries lo..hi-1 may attend keys 0..keys-1, as bool (batch or 1, 1, hi - lo,
    keys): causal (and within `window`) for mask None, the rows of a bool mask, or a
    FlexAttention BlockMask's mask_mod (which holds its window already)."""
    q_idx = torch.arange(lo, hi, device=device)
    kv_idx = torch.arange(keys, device=device)
    if mask is None:
        seen = q_idx[:, None] >= kv_idx[None, :]
        if window is not None:
            seen = seen & (q_idx[:, None] - kv_idx[None, :] < window)
        return seen[None, None]
    if isinstance(mask, torch.Tensor):
        rows = mask[..., lo:hi, :]
        if window is not None:
            rows = rows & (q_idx[:, None] - kv_idx[None, :] < window)
        return rows
    # a BlockMask: its mask_mod(b, h, q, kv) broadcasts over index tensors
    batch = torch.arange(mask.shape[0], device=device)[:, None, None]
    head = torch.zeros((), dtype=torch.long, device=device)
    return mask.mask_mod(batch, head, q_idx[None, :, None], kv_idx[None, None, :])[:, None]


def head_logit_max(
    q: torch.Tensor, k: torch.Tensor, scale: float, allowed, causal: bool = False
) -> torch.Tensor:
    """(heads,) float32: each query head's largest scale x q.k over the allowed pairs (-inf
    where it attends none). q (batch, queries, heads, d), k (batch, keys, kv heads, d); query
    head i reads key head i // (heads / kv heads), as grouped-query attention does;
    `allowed(lo, hi)` as allowed_pairs gives it. `causal`: the pairs are exactly the causal
    ones (queries and keys at the same positions), so a block of queries needs only the keys
    up to its last, and a mask only where it meets the diagonal."""
    batch, queries, heads, width = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # (batch, kv heads, group, queries, d) against (batch, kv heads, 1, d, keys), contiguous
    qh = q.transpose(1, 2).reshape(batch, kv_heads, group, queries, width).contiguous()
    kt = k.permute(0, 2, 3, 1).unsqueeze(2).contiguous()
    budget = BLOCK_SCORES.get(q.device.type, BLOCK_SCORES["cuda"])
    rows = max(1, budget // max(1, batch * heads * keys))
    best = torch.full((heads,), float("-inf"), device=q.device)
    for lo in range(0, queries, rows):
        hi = min(queries, lo + rows)
        block = qh[..., lo:hi, :]
        if causal:  # keys before the block: all seen; the block's own square: masked
            if lo:
                best = torch.maximum(best, _largest(block @ kt[..., :lo], heads))
            scores = block @ kt[..., lo:hi]
            seen = allowed_pairs(None, lo, hi, hi, q.device)[..., lo:]
        else:
            scores, seen = block @ kt, allowed(lo, hi)
        scores.masked_fill_(~seen[:, :, None], float("-inf"))
        best = torch.maximum(best, _largest(scores, heads))
    # scale > 0: the largest scaled logit is the largest product, scaled
    return best * scale


def _largest(scores: torch.Tensor, heads: int) -> torch.Tensor:
    return scores.amax(dim=(0, 3, 4)).reshape(heads).float()


def note_logit_max(buffer: torch.Tensor, q, k, scale: float, allowed, causal: bool = False) -> None:
    """buffer[:heads] = the larger of it and this forward's head_logit_max (a rank holding a
    slice of the heads fills the start of its buffer)."""
    with torch.no_grad():
        now = head_logit_max(q, k, scale, allowed, causal)
        buffer[: now.numel()] = torch.maximum(buffer[: now.numel()], now)
