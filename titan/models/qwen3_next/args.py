"""Qwen3-Next's flavors (titan.models.common.hybrid_args.HybridArgs), from the released config
of Qwen3-Next-80B-A3B: every layer's FFN a mixture of 512 experts, 10 a token, beside a gated
shared expert."""

from titan.models.common.hybrid_args import HYBRID_DEBUG, HybridArgs
from titan.models.common.moe_args import MoEArgs

QWEN3_NEXT_FLAVORS: dict[str, HybridArgs] = {
    # CPU-sized (4 layers: 3 linear, 1 full), 8 experts of which 2 a token, beside the shared
    # one; the first layer dense (mlp_only_layers) so both FFN kinds train
    "debugmodel": HYBRID_DEBUG.with_updates(
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=128),
        shared_expert_dim=128,
        mlp_only_layers=(0,),
        moe_aux_loss_coeff=0.001,
    ),
    "80B-A3B": HybridArgs(
        moe=MoEArgs(n_experts=512, top_k=10, hidden_dim=512),
        moe_aux_loss_coeff=0.001,
        context_len=262144,
    ),
}
