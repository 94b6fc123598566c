"""Llama 3 decoder: RMSNorm, RoPE (Llama 3.1 scaling), GQA attention, SwiGLU, an output
projection that may be tied to the embedding (Llama 3.2 1B/3B).

Pure model code: no parallelism here. Parallelisms rewrite a built model from outside;
submodules that a pipeline stage drops are set to None and skipped in forward.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.decode import DecodeCache
from titan.models.documents import block_causal_block_mask, block_causal_mask
from titan.models.init import normal, ones, seeded_init_
from titan.models.llama3.args import Llama3Args


def rope_frequencies(args: Llama3Args) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3.1's long-context rescaling if configured."""
    hd = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if args.rope_scaling_factor is None:
        return freqs
    factor, orig = args.rope_scaling_factor, args.rope_original_max_len
    low_wavelen = orig / args.rope_low_freq_factor
    high_wavelen = orig / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    smooth = (orig / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, blended)
    return torch.where(wavelen < high_wavelen, freqs, scaled)


def rope_cache(args: Llama3Args, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2) table of (cos, sin); kept real-valued for compile/DTensor."""
    freqs = rope_frequencies(args)
    t = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def flex_attention(q, k, v, block_mask):
    """FlexAttention, compiled once on first use: uncompiled it materializes every score."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention as eager

        _flex = torch.compile(eager, dynamic=False) if q.is_cuda else eager
    return _flex(q, k, v, block_mask=block_mask)


_flex = None


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim).

    `rope` is the table (max_seq_len, head_dim/2, 2), whose first rows are x's positions,
    or the rows of each sequence's positions, (batch, seq, head_dim/2, 2)."""
    if rope.dim() == 3:
        rope = rope[:x.shape[1]]
    pairs = x.float().unflatten(-1, (-1, 2))
    cos = rope[..., None, :, 0]
    sin = rope[..., None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: DecodeCache | None = None,
                layer: int = 0, mask=None) -> torch.Tensor:
        """`mask`: None (causal), a bool (batch, 1, seq, seq) tensor, or a FlexAttention
        BlockMask (see titan.models.documents)."""
        bs, seq, _ = x.shape
        rows = rope if cache is None else rope[cache.positions(seq)]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = apply_rope(self.wq(x).view(bs, seq, -1, self.head_dim), rows)
        k = apply_rope(self.wk(x).view(bs, seq, -1, self.head_dim), rows)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if cache is not None:
            mask = cache.mask(seq)
            k, v = cache.update(layer, k, v)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is not None and not isinstance(mask, torch.Tensor):
            out = flex_attention(q, k, v, block_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                cache: DecodeCache | None = None, mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache=cache, layer=self.layer_id,
                               mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_plan(self) -> dict:
        """Parameter name (within the block) -> how to fill it."""
        # depth-scaled std on the projections that write into the residual stream
        deep = normal(0.02 / math.sqrt(2 * (self.layer_id + 1)))
        return {
            "attention_norm.weight": ones, "ffn_norm.weight": ones,
            "attention.wq.weight": normal(0.02), "attention.wk.weight": normal(0.02),
            "attention.wv.weight": normal(0.02), "attention.wo.weight": deep,
            "feed_forward.w1.weight": normal(0.02), "feed_forward.w2.weight": deep,
            "feed_forward.w3.weight": deep,
        }

    def init_weights(self, seed: int, prefix: str) -> None:
        for name, fill in self.init_plan().items():
            module_path, _, pname = name.rpartition(".")
            param = getattr(self.get_submodule(module_path), pname)
            seeded_init_(param, f"{prefix}.{name}", seed, fill)


class Transformer(nn.Module):
    block_cls = TransformerBlock  # a variant family swaps the block (e.g. another FFN)

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # recomputed, never checkpointed: it is a pure function of the args
        self.register_buffer("rope", rope_cache(args), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: DecodeCache | None = None,
                doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every position; with `cache`, `tokens` continue the cached ones.

        `doc_ids` (batch, seq): attend only within each document (block-causal);
        `positions` (batch, seq): each token's RoPE position, when not 0, 1, 2, ..."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else self.rope[positions]
        if cache is not None:
            for layer in self.layers.values():
                h = layer(h, rope, cache=cache)
        else:
            mask = None if doc_ids is None else (
                block_causal_block_mask(doc_ids) if doc_ids.is_cuda else block_causal_mask(doc_ids))
            for layer in self.layers.values():
                h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.output(h) if self.output is not None else h

    def tied_parameters(self) -> list[tuple[str, str]]:
        # the name a checkpoint or HF file stores first, then the name that shares it
        return [("tok_embeddings.weight", "output.weight")] if self.args.tie_word_embeddings else []

    def cp_buffers(self) -> list[tuple[torch.Tensor, int]]:
        # RoPE rows are positions: under CP each rank keeps the rows of its sequence chunk
        return [(self.rope, 0)]

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter from (seed, its name), whatever the sharding."""
        self.rope = rope_cache(self.args, device=buffer_device or self.rope.device)
        out_init = normal(self.args.dim ** -0.5)
        tied = self.args.tie_word_embeddings
        if tied and self.tok_embeddings is not None and self.output is not None:
            # to_empty() gives each module its own new parameter: tie them again
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            # a tied matrix is scaled for its output role, where a large init would blow up
            # the first logits
            seeded_init_(self.tok_embeddings.weight, "tok_embeddings.weight", seed,
                         out_init if tied else normal(1.0, truncate=False))
        for layer_id, layer in self.layers.items():
            layer.init_weights(seed, f"layers.{layer_id}")
        if self.norm is not None:
            seeded_init_(self.norm.weight, "norm.weight", seed, ones)
        if self.output is not None and not (tied and self.tok_embeddings is not None):
            # a pipeline's last stage holds a copy of a tied matrix: the same values
            seeded_init_(self.output.weight, "tok_embeddings.weight" if tied else "output.weight",
                         seed, out_init)
