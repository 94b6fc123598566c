"""Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm (Qwen3) and a head
width of its own (not necessarily dim / n_heads); SDPA, FlexAttention for document masks, and
the decode cache for generation."""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.decode import DecodeCache
from titan.models.common.init import normal, ones
from titan.models.common.rope import apply_rope


def flex_attention(q, k, v, block_mask, enable_gqa=False, scale=None):
    """FlexAttention, compiled once per process on CUDA: uncompiled it materializes every
    score."""
    kernel = _flex_kernel(q.is_cuda)
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)


@functools.cache
def _flex_kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention as eager

    return torch.compile(eager, dynamic=False) if compiled else eager


class Attention(nn.Module):
    """Projections wq, wk, wv, wo (no bias); with `qk_norm_eps`, q_norm and k_norm normalize
    each head's query and key before the rotation."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        interleaved_rope: bool = True,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.interleaved_rope = interleaved_rope
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def param_inits(self, out_init) -> dict:
        """Parameter name -> how to fill it; `out_init` for wo, which writes the residual."""
        inits = {
            "wq.weight": normal(0.02),
            "wk.weight": normal(0.02),
            "wv.weight": normal(0.02),
            "wo.weight": out_init,
        }
        if self.q_norm is not None:
            inits.update({"q_norm.weight": ones, "k_norm.weight": ones})
        return inits

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: DecodeCache | None = None,
        layer: int = 0,
        mask=None,
    ) -> torch.Tensor:
        """`mask`: None (causal), a bool (batch, 1, seq, seq) tensor, or a FlexAttention
        BlockMask (see titan.models.common.documents)."""
        bs, seq, _ = x.shape
        rows = rope if cache is None else rope[cache.positions(seq)]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, rows, self.interleaved_rope)
        k = apply_rope(k, rows, self.interleaved_rope)
        if cache is not None:
            mask = cache.mask(seq)
            k, v = cache.update(layer, k, v)
        # each K/V head serves n_heads / n_kv_heads query heads inside the kernel: repeating
        # K/V first would copy them, and sum the copies' gradients back, in every layer
        gqa = q.shape[2] != k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is not None and not isinstance(mask, torch.Tensor):
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))
