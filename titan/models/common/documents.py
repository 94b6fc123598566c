"""Documents packed into one training window: which tokens may attend to which.

Every document starts with BOS, so a window's documents are the runs that BOS opens (the
window's first run may be the tail of a document begun in an earlier window). With a
block-causal mask a token attends only to earlier tokens of its own document; positions may
restart at each document, so a document sees exactly what it would see alone.
"""

import torch

# the batch field that says each token's document (chat windows carry it; plain text's are
# found from BOS), and the model's keyword argument for it
DOC_IDS = "doc_ids"


def document_kwargs(
    batch: dict[str, torch.Tensor], restart_positions: bool, bos_id: int
) -> dict[str, torch.Tensor]:
    """The model's arguments for a block-causal mask over a batch: the documents (the
    batch's own, else the runs BOS opens) and, when positions restart at each document, the
    positions."""
    docs = batch.get(DOC_IDS)
    if docs is None:
        docs = document_ids(batch["input_ids"], bos_id)
    out = {DOC_IDS: docs}
    if restart_positions:
        out["positions"] = document_positions(docs)
    return out


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """(batch, seq) int32: the index of each token's document within its window."""
    return torch.cumsum(tokens == bos_id, dim=-1, dtype=torch.int32)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int64: each token's position within its document."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    opens = torch.ones_like(doc_ids, dtype=torch.bool)
    opens[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    starts = torch.where(opens, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - starts


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool for scaled_dot_product_attention: True where a query may
    attend to a key."""
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]


def block_causal_mask_between(
    q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> torch.Tensor:
    """The same for queries and keys given apart, each with its document (batch, n) and
    window position (n,): a context-parallel rank's queries against every rank's keys."""
    causal = q_pos[:, None] >= k_pos[None, :]
    return ((q_docs[:, :, None] == k_docs[:, None, :]) & causal)[:, None]


def block_causal_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """The same mask as a FlexAttention BlockMask, which skips whole blocks that no query of
    a document reaches (the fast path on CUDA); with `window`, also only the `window` latest
    keys of each query (a sliding-window layer's)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)
        return seen if window is None else seen & (q_idx - kv_idx < window)

    batch, seq = doc_ids.shape
    return create_block_mask(mask_mod, batch, None, seq, seq, device=doc_ids.device)
