"""GPT-OSS on the common decoder, from the common blocks' options: attention with biases, a
learned sink per head and, in the sliding layers, a window; RoPE in the two-halves layout with
YaRN; in every layer a router with a bias whose top-k logits are softmaxed, and experts with
biases and a clamped SwiGLU."""

import functools

import torch

from titan.models.common.attention import Attention
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.moe import GroupedExperts, MoE, Router
from titan.models.common.rope import yarn_rope_table
from titan.models.gpt_oss.args import GptOssArgs


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """GPT-OSS's expert activation: the gate clamped above and the up projection on both
    sides at `limit`, then (up + 1) x gate x sigmoid(alpha x gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def rope_cache(args: GptOssArgs, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2) table of (cos, sin), YaRN-stretched and scaled by its
    attention temperature as released."""
    return yarn_rope_table(
        args.head_dim,
        args.rope_theta,
        args.max_seq_len,
        args.rope_scaling_factor,
        args.rope_original_max_len,
        args.rope_beta_fast,
        args.rope_beta_slow,
        truncate=args.rope_truncate,
        device=device,
    )


class GptOss(Decoder):
    def build_block(self, layer_id: int, args: GptOssArgs) -> TransformerBlock:
        moe = args.moe_args()
        activation = functools.partial(
            clamped_swiglu, limit=args.swiglu_limit, alpha=args.swiglu_alpha
        )
        ffn = MoE(
            args.dim,
            moe,
            router=Router(args.dim, moe, bias=True),
            experts=GroupedExperts(
                args.dim, moe.hidden_dim, moe.n_experts, activation=activation, bias=True
            ),
        )
        attention = Attention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            interleaved_rope=False,
            bias=True,
            sliding_window=args.window(layer_id),
            sinks=True,
        )
        return TransformerBlock(layer_id, args.dim, args.norm_eps, attention, ffn)

    def layer_window(self, layer_id: int, args: GptOssArgs) -> int | None:
        return args.window(layer_id)

    rope_table = staticmethod(rope_cache)
