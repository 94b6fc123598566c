"""DeepSeek-V3 on the common decoder: multi-head latent attention, dense SwiGLU layers first,
then sigmoid-routed, group-limited experts beside shared experts."""

import math

import torch

from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.feed_forward import FeedForward
from titan.models.common.moe import MoE
from titan.models.common.rope import inverse_frequencies, rope_table, yarn_mscale, yarn_scaled
from titan.models.deepseek_v3.args import DeepSeekV3Args
from titan.models.deepseek_v3.mla import MLA


def rope_cache(args: DeepSeekV3Args, device=None) -> torch.Tensor:
    """(max_seq_len, qk_rope_head_dim/2, 2) table of (cos, sin); with YaRN, scaled by the
    ratio of its two temperatures (1 for DeepSeek-V3's equal mscales, as in HF)."""
    dim = args.qk_rope_head_dim
    if args.rope_scaling_factor is None:
        return rope_table(
            inverse_frequencies(dim, args.rope_theta), args.max_seq_len, device=device
        )
    factor = args.rope_scaling_factor
    freqs = yarn_scaled(
        dim,
        args.rope_theta,
        factor,
        args.rope_original_max_len,
        args.rope_beta_fast,
        args.rope_beta_slow,
    )
    if args.rope_mscale and args.rope_mscale_all_dim:
        scale = yarn_mscale(factor, args.rope_mscale) / yarn_mscale(
            factor, args.rope_mscale_all_dim
        )
    else:
        scale = yarn_mscale(factor)
    return rope_table(freqs, args.max_seq_len, scale=scale, device=device)


def softmax_scale(args: DeepSeekV3Args) -> float:
    """1/sqrt(head_dim), times YaRN's temperature squared when mscale_all_dim is set."""
    scale = 1 / math.sqrt(args.head_dim)
    if args.rope_scaling_factor is not None and args.rope_mscale_all_dim:
        scale *= yarn_mscale(args.rope_scaling_factor, args.rope_mscale_all_dim) ** 2
    return scale


class DeepSeekV3(Decoder):
    def build_block(self, layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
        attention = MLA(
            args.dim,
            args.n_heads,
            args.q_lora_rank,
            args.kv_lora_rank,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
            softmax_scale(args),
            args.interleaved_rope,
        )
        ffn = (
            MoE(args.dim, args.moe_args())
            if args.is_moe_layer(layer_id)
            else FeedForward(args.dim, args.ffn_hidden_dim)
        )
        return TransformerBlock(layer_id, args.dim, args.norm_eps, attention, ffn)

    rope_table = staticmethod(rope_cache)
