"""Qwen3.5's flavors: the text model of Qwen3.5 (dense and MoE) is the hybrid decoder of
Qwen3-Next (titan.models.common.hybrid_args.HybridArgs: Gated DeltaNet in three of every four
layers, gated full attention with RoPE on a quarter of each head in the fourth, zero-centred
norms);
the MoE sizes route every layer, 8 or 10 experts a token beside a gated shared expert. Sizes
from the released configs' text_config (the vision tower and the MTP layer are not trained
here)."""

from titan.models.common.hybrid_args import HYBRID_DEBUG, HybridArgs
from titan.models.common.moe_args import MoEArgs

_RELEASED = HybridArgs(vocab_size=248320, context_len=262144)


def _moe(n_experts: int, top_k: int, hidden: int) -> dict:
    return {
        "moe": MoEArgs(n_experts=n_experts, top_k=top_k, hidden_dim=hidden),
        "shared_expert_dim": hidden,
        "moe_aux_loss_coeff": 0.001,
        # no dense layer: the width a hub config of all-MoE layers leaves out
        "ffn_hidden_dim": HybridArgs.ffn_hidden_dim,
    }


QWEN3_5_FLAVORS: dict[str, HybridArgs] = {
    # CPU-sized (4 layers: 3 linear, 1 full), dense
    "debugmodel": HYBRID_DEBUG,
    # CPU-sized, MoE in every layer (as the released MoE sizes)
    "debugmodel_moe": HYBRID_DEBUG.with_updates(**_moe(8, 2, 128)),
    "27B": _RELEASED.with_updates(
        dim=5120,
        n_layers=64,
        n_heads=24,
        n_kv_heads=4,
        linear_v_heads=48,
        ffn_hidden_dim=17408,
    ),
    "35B-A3B": _RELEASED.with_updates(
        dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, linear_v_heads=32, **_moe(256, 8, 512)
    ),
    "122B-A10B": _RELEASED.with_updates(
        dim=3072, n_layers=48, n_heads=32, n_kv_heads=2, linear_v_heads=64, **_moe(256, 8, 1024)
    ),
    "397B-A17B": _RELEASED.with_updates(
        dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, linear_v_heads=64, **_moe(512, 10, 1024)
    ),
}
