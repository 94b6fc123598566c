"""DeepSeek-V3 on the common decoder: multi-head latent attention, dense SwiGLU layers first,
then sigmoid-routed, group-limited experts beside shared experts; optionally multi-token
prediction depths after them (titan.models.deepseek_v3.mtp)."""

import math

import torch

from titan.models.common.aux_loss import collecting
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.feed_forward import FeedForward
from titan.models.common.init import normal, seeded_init_
from titan.models.common.moe import MoE
from titan.models.common.rope import inverse_frequencies, rope_table, yarn_mscale, yarn_scaled
from titan.models.deepseek_v3.args import DeepSeekV3Args
from titan.models.deepseek_v3.mla import MLA
from titan.models.deepseek_v3.mtp import MTPBlock, attach_mtp_loss, mtp_loss


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
    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        # the prediction depths, after the main blocks and named as the hub names them, and
        # the embedding they share with the input (one module under two names: a pipeline's
        # last stage holds it as mtp_embeddings only)
        for k in range(args.mtp_depth):
            self.layers[str(args.n_layers + k)] = self.build_block(args.n_layers + k, args)
        self.mtp_embeddings = self.tok_embeddings if args.mtp_depth else None
        self.takes_labels = args.mtp_depth > 0

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
        block = MTPBlock if layer_id >= args.n_layers else TransformerBlock
        return block(layer_id, args.dim, args.norm_eps, attention, ffn)

    rope_table = staticmethod(rope_cache)

    def head(self, h, rope, mask, labels):
        depths = [self.layers[str(self.args.n_layers + k)] for k in range(self.args.mtp_depth)]
        # a training forward (the memory planner's too): validation and generation skip it
        if depths and labels is not None and torch.is_grad_enabled():
            loss = mtp_loss(depths, self.mtp_embeddings, self.output, h, labels, rope, mask)
            if collecting():
                # on the hidden states, not the logits: an FSDP root must not return a view
                h = attach_mtp_loss(h, loss, self.args.mtp_loss_weight)
        return super().head(h, rope, mask, labels)

    def tied_parameters(self) -> list[tuple[str, str]]:
        ties = super().tied_parameters()
        if self.args.mtp_depth:
            ties.append(("tok_embeddings.weight", "mtp_embeddings.weight"))
        return ties

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        super().init_weights(seed, buffer_device)
        if self.mtp_embeddings is not None and self.tok_embeddings is None:
            # a pipeline's last stage: its copy of the embedding starts as the first's
            tied = self.args.tie_word_embeddings
            fill = normal(self.args.dim**-0.5) if tied else normal(1.0, truncate=False)
            seeded_init_(self.mtp_embeddings.weight, "tok_embeddings.weight", seed, fill)
