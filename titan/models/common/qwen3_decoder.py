"""Qwen3 on the common decoder: GQA attention whose heads are RMS-normalized before the
rotation (q_norm, k_norm), a head width of its own, RoPE in the two-halves layout its
checkpoints use (optionally YaRN-extended), SwiGLU, and an output tied to the embedding in the
small sizes. Qwen3-MoE puts a softmax-routed mixture of experts in place of the SwiGLU in its
sparse layers. Shared by the qwen3 and qwen3_vl families."""

import torch

from titan.models.common.attention import Attention
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.feed_forward import FeedForward
from titan.models.common.moe import MoE
from titan.models.common.qwen3_args import Qwen3Args
from titan.models.common.rope import yarn_rope_table


def rope_cache(args: Qwen3Args, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2) table of (cos, sin); YaRN also scales it by its
    attention temperature."""
    return yarn_rope_table(
        args.head_dim,
        args.rope_theta,
        args.max_seq_len,
        args.rope_scaling_factor,
        args.rope_original_max_len,
        args.rope_beta_fast,
        args.rope_beta_slow,
        device=device,
    )


class Qwen3(Decoder):
    def build_block(self, layer_id: int, args: Qwen3Args) -> TransformerBlock:
        return TransformerBlock(
            layer_id,
            args.dim,
            args.norm_eps,
            Attention(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                qk_norm_eps=args.norm_eps,
                interleaved_rope=False,
            ),
            MoE(args.dim, args.moe_args())
            if args.is_moe_layer(layer_id)
            else FeedForward(args.dim, args.ffn_hidden_dim),
        )

    rope_table = staticmethod(rope_cache)
