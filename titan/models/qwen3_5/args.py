"""Qwen3.5's flavors: the text model of Qwen3.5 (dense and MoE) is the hybrid decoder of
Qwen3-Next (titan.models.common.hybrid_args.HybridArgs: Gated DeltaNet in three of every four
layers, gated full attention with RoPE on a quarter of each head in the fourth, zero-centred
norms);
the MoE sizes route every layer, 8 or 10 experts a token beside a gated shared expert. Sizes
from the released configs' text_config (the MTP layer is not trained here). The released
models are multimodal: each size's `-vision` flavor carries the vision tower (27 blocks of
width 1152, titan.models.common.vision) and multimodal rotary positions (mrope_section 11,
11, 10 of the 32 rotated pairs); the plain sizes are the text model alone."""

from dataclasses import dataclass, fields, replace

from titan.models.common.hybrid_args import HYBRID_DEBUG, HybridArgs
from titan.models.common.moe_args import MoEArgs
from titan.models.common.vision_args import VISION_DEBUG, VisionArgs, VisionLanguageFields


@dataclass(frozen=True)
class Qwen3_5Args(VisionLanguageFields, HybridArgs):
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    image_token_id: int = 248056
    vision_start_id: int = 248053
    vision_end_id: int = 248054

    def with_updates(self, **kw) -> "Qwen3_5Args":
        return replace(self, **kw)

    def problems(self) -> list[str]:
        return super().problems() + self.vision_problems(self.rotary_dim // 2)


def mrope_sections(rotary_dim: int) -> tuple[int, int, int]:
    """Qwen3.5's split of a head's rotated pairs into (time, rows, columns): a third (rounded
    down) to columns, the rest halved."""
    pairs = rotary_dim // 2
    rest = pairs - pairs // 3
    return (rest - rest // 2, rest // 2, pairs // 3)


TEXT_FIELDS = [f.name for f in fields(HybridArgs)]


def _args(base: HybridArgs, **kw) -> Qwen3_5Args:
    own = {k: getattr(base, k) for k in TEXT_FIELDS}
    return Qwen3_5Args(**{**own, "mrope_section": mrope_sections(base.rotary_dim), **kw})


_RELEASED = _args(HybridArgs(vocab_size=248320, context_len=262144))
_DEBUG = _args(HYBRID_DEBUG)
# CPU-sized tower; the ids of assets/tokenizer_vlm's vision tokens
_DEBUG_VISION = dict(
    vision=VISION_DEBUG.with_updates(out_dim=HYBRID_DEBUG.dim),
    vocab_size=2053,  # assets/tokenizer_vlm's
    vision_start_id=2050,
    vision_end_id=2051,
    image_token_id=2052,
)


def _moe(n_experts: int, top_k: int, hidden: int) -> dict:
    return {
        "moe": MoEArgs(n_experts=n_experts, top_k=top_k, hidden_dim=hidden),
        "shared_expert_dim": hidden,
        "moe_aux_loss_coeff": 0.001,
        # no dense layer: the width a hub config of all-MoE layers leaves out
        "ffn_hidden_dim": HybridArgs.ffn_hidden_dim,
    }


_SIZES: dict[str, Qwen3_5Args] = {
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

QWEN3_5_FLAVORS: dict[str, Qwen3_5Args] = {
    # CPU-sized (4 layers: 3 linear, 1 full), dense
    "debugmodel": _DEBUG,
    # CPU-sized, MoE in every layer (as the released MoE sizes)
    "debugmodel_moe": _DEBUG.with_updates(**_moe(8, 2, 128)),
    "debugmodel_vision": _DEBUG.with_updates(**_DEBUG_VISION),
    "debugmodel_moe_vision": _DEBUG.with_updates(**_moe(8, 2, 128), **_DEBUG_VISION),
    **_SIZES,
    **{
        f"{name}-vision": args.with_updates(vision=VisionArgs(out_dim=args.dim))
        for name, args in _SIZES.items()
    },
}
