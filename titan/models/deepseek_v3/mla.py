"""Multi-head latent attention (DeepSeek-V2/V3): keys and values are expanded per head from
one low-rank latent of each token, queries optionally through a bottleneck of their own; each
head's query and key are a part without position and a rotated part, whose key one projection
shares among all heads. Softmax over query/key heads of one width, values of another."""

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.attention import flex_attention
from titan.models.common.aux_loss import first_forward_of_step
from titan.models.common.decode import DecodeCache
from titan.models.common.init import normal, ones
from titan.models.common.logit_max import allowed_pairs, note_logit_max
from titan.models.common.rope import apply_rope
from titan.parallelisms import sequence_shard

# the latent norms of DeepSeek's checkpoints (transformers' default epsilon, whatever the
# model's rms_norm_eps)
LATENT_NORM_EPS = 1e-6


class SharedRopeKey(nn.Module):
    """Rotates the key part every head shares: (batch, seq, width) -> (batch, seq, 1, width).
    Its own module so that tensor parallelism can sum the gradient of what all ranks' heads
    read (titan.parallelisms.tensor_parallel.SumInputGrads)."""

    def __init__(self, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved

    def forward(self, k_rope: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return apply_rope(k_rope.unsqueeze(2), rows, self.interleaved)


class MLA(nn.Module):
    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        interleaved_rope: bool = True,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.softmax_scale = softmax_scale
        self.interleaved_rope = interleaved_rope
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.rope_key = SharedRopeKey(interleaved_rope)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        # (heads,) once track_logit_max() is called: see titan.models.common.logit_max
        self.register_buffer("logit_max", None, persistent=False)

    def track_logit_max(self) -> None:
        self.logit_max = torch.full((self.n_heads,), float("-inf"), device=self.wo.weight.device)

    def qk_clip_scales(self, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row factors (parameter name -> one per output row) that multiply head h's
        logits by gamma[h], as Kimi K2 clips MLA: sqrt(gamma) on the head's query and key
        parts without position, gamma on its rotated query part; the rotated key part, which
        all heads share, and the values untouched."""
        root, ones_v = gamma.sqrt()[:, None], gamma.new_ones(gamma.numel(), self.v_dim)
        q = torch.cat([root.expand(-1, self.nope), gamma[:, None].expand(-1, self.rope_dim)], 1)
        kv = torch.cat([root.expand(-1, self.nope), ones_v], 1)
        q_name = "wq_b" if hasattr(self, "wq_b") else "wq"
        return {f"{q_name}.weight": q.reshape(-1), "wkv_b.weight": kv.reshape(-1)}

    def param_inits(self, out_init) -> dict:
        inits = {
            f"{name}.weight": normal(0.02)
            for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b")
            if hasattr(self, name)
        }
        inits.update(
            {f"{name}.weight": ones for name in ("q_norm", "kv_norm") if hasattr(self, name)}
        )
        return {**inits, "wo.weight": out_init}

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: DecodeCache | None = None,
        layer: int = 0,
        mask=None,
    ) -> torch.Tensor:
        """`mask` as titan.models.common.attention.Attention takes it."""
        bs, seq, _ = x.shape
        rows = rope if cache is None else rope[cache.positions(seq)]
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q_nope, q_rope = q.view(bs, seq, -1, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], dim=-1
        )
        q = torch.cat([q_nope, apply_rope(q_rope, rows, self.interleaved_rope)], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = (
            self.wkv_b(self.kv_norm(latent))
            .view(bs, seq, -1, self.nope + self.v_dim)
            .split([self.nope, self.v_dim], -1)
        )
        k_rope = self.rope_key(k_rope, rows)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.logit_max is not None and first_forward_of_step():
            note_logit_max(
                self.logit_max,
                q,
                k,
                self.softmax_scale,
                lambda lo, hi: allowed_pairs(mask, lo, hi, seq, q.device),
                causal=mask is None,
            )
        if cache is not None:
            mask = cache.mask(seq)
            k, v, _ = cache.update(layer, k, v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        shard = sequence_shard.active()
        if shard is not None and shard.by_heads:
            # all-to-all CP: every token of 1/cp of the heads here, attended as on one rank
            q, k, v = shard.heads_in(q), shard.heads_in(k), shard.heads_in(v)
            # the hybrid's groups gather each other's keys: shard.outer()
            sdpa = sequence_shard.plain_sdpa
            out = shard.heads_out(self._attend(q, k, v, mask, shard.outer(), sdpa, ring=False))
        else:
            out = self._attend(q, k, v, mask, shard, F.scaled_dot_product_attention, ring=True)
        return self.wo(out[..., : self.v_dim].transpose(1, 2).reshape(bs, seq, -1))

    def _attend(self, q, k, v, mask, shard, sdpa, ring: bool) -> torch.Tensor:
        if mask is not None and not isinstance(mask, torch.Tensor):
            return flex_attention(q, k, padded(v, q), block_mask=mask, scale=self.softmax_scale)
        if shard is not None and (mask is not None or not ring):
            # every rank's keys round the ring, the mask (documents, or causal) by position
            if mask is None:
                mask = (shard.positions[:, None] >= shard.all_positions()[None, :])[None, None]
            return shard.attend(q, k, padded(v, q), mask, scale=self.softmax_scale)
        if not narrow_values_fit(q):
            v = padded(v, q)
        return sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale)


def padded(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Values padded with zeros to the query/key width (the caller drops the output columns
    past the values' own): the CPU's flash kernel, FlashAttention-2 (HF pads alike), flex
    attention and context parallelism's ring attention take one width for all three."""
    return F.pad(v, (0, q.shape[-1] - v.shape[-1]))


def narrow_values_fit(q: torch.Tensor) -> bool:
    """CUDA's SDPA takes values narrower than queries as they are (cuDNN's and the
    memory-efficient kernels do; flash is skipped): on an H100, cuDNN's backward over padded
    values took twice the time of the unpadded one (12.6 vs 6.8 ms a layer at Moonlight's
    width, seq 8192, batch 4)."""
    return q.device.type == "cuda"
