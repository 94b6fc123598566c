"""The hybrid linear-attention decoder of Qwen3-Next and Qwen3.5 on the common decoder: blocks
whose token mixer is Gated DeltaNet (titan.models.common.gated_deltanet) in three of every four
layers and gated full attention (common Attention with its output gate, RoPE on part of each
head) in the fourth; SwiGLU or a softmax-routed MoE with a gated shared expert; zero-centred
RMSNorms everywhere. A family subclasses HybridDecoder under its own name.

A linear layer's "mask" is the tokens that start a document (the decoder builds one per layer
kind: `_masks`); its decode state lives in the decode cache beside the attention layers' keys.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.attention import Attention
from titan.models.common.decode import DecodeCache
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.feed_forward import FeedForward
from titan.models.common.gated_deltanet import GatedDeltaNet
from titan.models.common.hybrid_args import HybridArgs
from titan.models.common.init import normal, zeros
from titan.models.common.moe import MoE
from titan.models.common.rope import yarn_rope_table
from titan.parallelisms import sequence_shard

LINEAR = "linear"  # the mask key of linear layers: their documents' first tokens


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """RMSNorm scaling by 1 + weight (weight starts at 0, and weight decay pulls the scale
    towards 1, not 0), in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GatedSharedExpert(FeedForward):
    """The shared expert: a SwiGLU whose output a per-token sigmoid gate scales (applied to
    its hidden units, the same product, so that under tensor parallelism each rank gates its
    own columns)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden)
        self.gate = nn.Linear(dim, 1, bias=False)

    def param_inits(self, out_init) -> dict:
        return {**super().param_inits(out_init), "gate.weight": normal(0.02)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.w1(x)) * self.w3(x)
        return self.w2(hidden * torch.sigmoid(self.gate(x)))


class LinearAttention(GatedDeltaNet):
    """Gated DeltaNet in a block's attention slot: `mask` is the document starts (or None),
    and with a decode cache its state is kept there under the layer's index."""

    def forward(self, x, rope=None, cache: DecodeCache | None = None, layer: int = 0, mask=None):
        if cache is None:
            return super().forward(x, resets=mask)[0]
        # left padding (a batch of prompts of several lengths) enters as zeros: nothing is
        # written to the state and the convolution reads zeros, as before the first token
        seq = x.shape[1]
        index = torch.arange(cache.length, cache.length + seq, device=x.device)
        x = x.masked_fill((index[None, :] < cache.pad[:, None])[..., None], 0)
        out, cache.kv[layer] = super().forward(x, state=cache.kv.get(layer))
        return out


class HybridBlock(TransformerBlock):
    def __init__(self, layer_id: int, args: HybridArgs, mixer: nn.Module, ffn: nn.Module):
        super().__init__(layer_id, args.dim, args.norm_eps, mixer, ffn)
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)

    def param_inits(self) -> dict:
        inits = super().param_inits()
        for name in inits:
            if name.endswith("norm.weight") and name != "attention.norm.weight":
                inits[name] = zeros  # zero-centred: scale 1
        return inits


class HybridDecoder(Decoder):
    def __init__(self, args: HybridArgs):
        super().__init__(args)
        self.norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)

    def build_block(self, layer_id: int, args: HybridArgs) -> nn.Module:
        if args.is_linear_layer(layer_id):
            mixer = LinearAttention(
                args.dim,
                args.linear_k_heads,
                args.linear_v_heads,
                args.linear_k_dim,
                args.linear_v_dim,
                args.conv_kernel,
                args.norm_eps,
            )
        else:
            mixer = Attention(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                qk_norm_eps=args.norm_eps,
                interleaved_rope=False,
                gate=True,
                rotary_dim=args.rotary_dim,
                qk_norm=ZeroCenteredRMSNorm,
            )
        if args.is_moe_layer(layer_id):
            shared = GatedSharedExpert(args.dim, args.shared_expert_dim)
            ffn = MoE(args.dim, args.moe_args(), shared=shared)
        else:
            ffn = FeedForward(args.dim, args.ffn_hidden_dim)
        return HybridBlock(layer_id, args, mixer, ffn)

    def layer_window(self, layer_id: int, args: HybridArgs):
        return LINEAR if args.is_linear_layer(layer_id) else None

    def attention_windows(self) -> set:
        return {w for w in self.sliding_windows if w != LINEAR}

    def _masks(self, doc_ids: torch.Tensor | None) -> dict:
        masks = super()._masks(doc_ids)
        if doc_ids is not None:
            # under context parallelism the linear layers run whole sequences (by heads)
            shard = sequence_shard.active()
            if shard is not None:
                doc_ids = shard.whole(doc_ids, dim=1)
            starts = torch.zeros_like(doc_ids, dtype=torch.bool)
            starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            masks[LINEAR] = starts
        return masks

    @staticmethod
    def rope_table(args: HybridArgs, device=None) -> torch.Tensor:
        return yarn_rope_table(
            args.rotary_dim, args.rope_theta, args.max_seq_len, None, 0, device=device
        )

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        super().init_weights(seed, buffer_device)
        if self.norm is not None:
            self.norm.weight.zero_()  # zero-centred: scale 1
