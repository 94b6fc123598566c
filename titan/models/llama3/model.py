"""Llama 3 on the common decoder: RoPE with Llama 3.1's long-context scaling in Meta's
interleaved layout, GQA attention, SwiGLU, an output projection that may be tied to the
embedding (Llama 3.2 1B/3B)."""

import torch

from titan.models.common.attention import Attention
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.feed_forward import FeedForward
from titan.models.common.rope import apply_rope, inverse_frequencies, llama3_scaled, rope_table
from titan.models.llama3.args import Llama3Args

__all__ = ["Transformer", "apply_rope", "rope_cache", "rope_frequencies"]


def rope_frequencies(args: Llama3Args) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3.1's long-context rescaling if configured."""
    freqs = inverse_frequencies(args.head_dim, args.rope_theta)
    if args.rope_scaling_factor is None:
        return freqs
    return llama3_scaled(
        freqs,
        args.rope_scaling_factor,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_original_max_len,
    )


def rope_cache(args: Llama3Args, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2) table of (cos, sin)."""
    return rope_table(rope_frequencies(args), args.max_seq_len, device=device)


class Transformer(Decoder):
    def build_block(self, layer_id: int, args: Llama3Args) -> TransformerBlock:
        return TransformerBlock(
            layer_id,
            args.dim,
            args.norm_eps,
            Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim),
            FeedForward(args.dim, args.ffn_hidden_dim),
        )

    rope_table = staticmethod(rope_cache)
