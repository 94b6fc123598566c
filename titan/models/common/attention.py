"""Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm (Qwen3) and a head
width of its own (not necessarily dim / n_heads); SDPA, FlexAttention for document masks, and
the decode cache for generation. Options a family sets per layer: biases on the projections, a
sliding window (each query sees the `sliding_window` latest keys, itself included), learned
per-head sinks (a logit per head that joins every query's softmax and attends to nothing), an
output gate (Qwen3-Next: each head's output times the sigmoid of a gate projected with its
query) and RoPE on the first `rotary_dim` dims of each head only."""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.aux_loss import first_forward_of_step
from titan.models.common.decode import DecodeCache
from titan.models.common.init import normal, ones, zeros
from titan.models.common.logit_max import allowed_pairs, note_logit_max
from titan.models.common.masked_attention import masked_attention
from titan.models.common.rope import apply_rope
from titan.parallelisms import sequence_shard


def flex_attention(q, k, v, block_mask, enable_gqa=False, scale=None, lse=False):
    """FlexAttention, compiled once per process on CUDA: uncompiled it materializes every
    score. With `lse`: (output, each row's log-sum-exp of its scores)."""
    kernel = _flex_kernel(q.is_cuda)
    if not lse:
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = kernel(
        q,
        k,
        v,
        block_mask=block_mask,
        enable_gqa=enable_gqa,
        scale=scale,
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """True where a key lies within the query's window: 0 <= q - k < window."""
    return q_pos[..., :, None] - k_pos[..., None, :] < window


@functools.cache
def _flex_kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention as eager

    return torch.compile(eager, dynamic=False) if compiled else eager


class Attention(nn.Module):
    """Projections wq, wk, wv, wo (with biases when `bias`); with `qk_norm_eps`, q_norm and
    k_norm normalize each head's query and key before the rotation; `sliding_window` limits
    each query to that many latest keys; `sinks` adds a learned logit per head to every
    softmax."""

    # multiplies the rotated queries, so every attention path (SDPA, flex, rings, decoding,
    # the logit max) sees softmax scale q_scale / sqrt(head_dim); a converter sets it (muP's
    # 1/head_dim scaling)
    q_scale = 1.0

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        interleaved_rope: bool = True,
        bias: bool = False,
        sliding_window: int | None = None,
        sinks: bool = False,
        gate: bool = False,
        rotary_dim: int | None = None,
        qk_norm: type[nn.Module] = nn.RMSNorm,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.interleaved_rope = interleaved_rope
        self.sliding_window = sliding_window
        self.gated, self.rotary_dim = gate, rotary_dim
        # with the gate, each head's query rows are followed by its gate's (the hub's layout,
        # which a tensor-parallel split of the heads keeps together)
        self.wq = nn.Linear(dim, n_heads * head_dim * (2 if gate else 1), bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = qk_norm(head_dim, eps=qk_norm_eps)
            self.k_norm = qk_norm(head_dim, eps=qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # (heads,): a tensor-parallel plan splits it with the heads
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        # (heads,) once track_logit_max() is called: see titan.models.common.logit_max
        self.register_buffer("logit_max", None, persistent=False)

    @property
    def normalizes_qk(self) -> bool:
        return self.q_norm is not None

    def track_logit_max(self) -> None:
        self.logit_max = torch.full((self.n_heads,), float("-inf"), device=self.wq.weight.device)

    def qk_clip_scales(self, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row factors (parameter name -> one per output row) that multiply head h's
        logits by gamma[h]: sqrt(gamma) on its query and key rows where each query head has
        its own key head; with grouped keys (shared by several query heads) gamma on its
        query rows only."""
        if self.n_kv_heads == self.n_heads:
            q = k = gamma.sqrt().repeat_interleave(self.head_dim)
            scales = {"wq": q, "wk": k}
        else:
            q = gamma.repeat_interleave(self.head_dim)
            scales = {"wq": q}
        if self.gated:  # each head's gate rows follow its query rows, unscaled
            heads = q.view(-1, self.head_dim)
            scales["wq"] = torch.cat([heads, torch.ones_like(heads)], 1).flatten()
        biased = self.wq.bias is not None
        names = ("weight", "bias") if biased else ("weight",)
        return {f"{w}.{n}": rows for w, rows in scales.items() for n in names}

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
        if self.wq.bias is not None:
            inits.update({f"{w}.bias": zeros for w in ("wq", "wk", "wv", "wo")})
        if self.sinks is not None:
            inits["sinks"] = zeros
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
        BlockMask (see titan.models.common.documents), which for a layer with a sliding window
        must hold the window already (the decoder builds one per window)."""
        bs, seq, _ = x.shape
        # with a cache the table's rows are picked here, unless the model gave each token's
        rows = rope if cache is None or rope.dim() == 4 else rope[cache.positions(seq)]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bs, seq, -1, self.head_dim * (2 if self.gated else 1))
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, rows), self._rotate(k, rows)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if self.logit_max is not None and first_forward_of_step():
            window, keys = self.sliding_window, k.shape[1]
            note_logit_max(
                self.logit_max,
                q,
                k,
                self.head_dim**-0.5,
                lambda lo, hi: allowed_pairs(mask, lo, hi, keys, q.device, window),
                causal=mask is None and window is None,
            )
        first = 0  # the position of the first key (a windowed cache keeps the latest only)
        if cache is not None:
            k, v, first = cache.update(layer, k, v, self.sliding_window)
            mask = cache.mask(seq, first)
        # each K/V head serves n_heads / n_kv_heads query heads inside the kernel: repeating
        # K/V first would copy them, and sum the copies' gradients back, in every layer
        gqa = q.shape[2] != k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        shard = sequence_shard.active()
        if shard is not None and shard.by_heads:
            # all-to-all CP: every token of 1/cp of the heads here, attended as on one rank
            q, k, v = shard.heads_in(q), shard.heads_in(k), shard.heads_in(v)
            sinks = shard.head_slice(self.sinks)
            # the hybrid's groups gather each other's keys: shard.outer()
            sdpa = sequence_shard.plain_sdpa
            out = self._attend(q, k, v, mask, first, gqa, shard.outer(), sinks, sdpa, ring=False)
            out = shard.heads_out(out)
        else:
            sdpa = F.scaled_dot_product_attention  # ring attention while CP is active
            out = self._attend(q, k, v, mask, first, gqa, shard, self.sinks, sdpa, ring=True)
        out = out.transpose(1, 2)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(bs, seq, -1))

    def _rotate(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """RoPE on each head's first rotary_dim dims (all without a rotary_dim)."""
        if self.rotary_dim is None:
            return apply_rope(x, rows, self.interleaved_rope)
        turned = apply_rope(x[..., : self.rotary_dim], rows, self.interleaved_rope)
        return torch.cat([turned, x[..., self.rotary_dim :]], dim=-1)

    def _attend(self, q, k, v, mask, first: int, gqa: bool, shard, sinks, sdpa, ring: bool):
        """Attention of (batch, heads, seq, d) q, k, v: SDPA where it can, FlexAttention for
        a BlockMask, else written out; with `shard` (context parallelism) torch's ring
        attention for a causal mask where `ring` (`sdpa` is torch's), else titan's ring with
        the mask by position."""
        plain = self.sliding_window is None and sinks is None
        if mask is not None and not isinstance(mask, torch.Tensor):
            return self._flex(q, k, v, mask, gqa, sinks)
        if plain and (shard is None or (mask is None and ring)):
            return sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        if shard is not None:
            # a window, sinks or documents under CP: every rank's keys come round the ring,
            # masked by position (torch's ring attention runs causal SDPA only)
            mask = self._windowed(mask, shard.positions, shard.all_positions())
            return shard.attend(q, k, v, mask, sinks)
        keys = k.shape[2]
        k_pos = torch.arange(first, first + keys, device=k.device)
        # the new tokens are the last `seq` keys
        mask = self._windowed(mask, k_pos[keys - q.shape[2] :], k_pos)
        if sinks is None:
            return sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return masked_attention(q, k, v, mask, sinks)

    def _flex(self, q, k, v, block_mask, gqa: bool, sinks) -> torch.Tensor:
        if sinks is None:
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        out, lse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, lse=True)
        # the sink joins the denominator: out x Z / (Z + e^sink), Z = e^lse
        keep = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
        return out * keep[..., None].to(out.dtype)

    def _windowed(self, mask, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The bool mask (batch or 1, 1, queries, keys) of causal (or `mask`) and the
        window, from the positions of the queries and keys."""
        if mask is None:
            mask = (q_pos[:, None] >= k_pos[None, :])[None, None]
        if self.sliding_window is not None:
            mask = mask & window_mask(q_pos, k_pos, self.sliding_window)
        return mask
