"""Qwen3-VL's hyper-parameters and flavors: Qwen3's text model (dense or MoE) with multimodal
rotary positions (mrope_section 24, 20, 20 of a head's 64 pairs) and a vision tower whose
DeepStack features enter its first decoder layers. Sizes from the released configs (text
sizes as Qwen3's, RoPE base 5M, 262,144 positions; a 24-block tower of width 1024 for 2B and
4B, 27 blocks of 1152 above)."""

from dataclasses import dataclass, replace

from titan.models.common.moe_args import MoEArgs
from titan.models.common.qwen3_args import Qwen3Args
from titan.models.common.vision_args import VISION_DEBUG, VisionArgs, VisionLanguageFields


@dataclass(frozen=True)
class Qwen3VLArgs(VisionLanguageFields, Qwen3Args):
    def with_updates(self, **kw) -> "Qwen3VLArgs":
        return replace(self, **kw)

    def problems(self) -> list[str]:
        return super().problems() + self.vision_problems(self.head_dim // 2)


_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim")
_TOWER_SMALL = VisionArgs(depth=24, dim=1024, ffn_dim=4096, deepstack_layers=(5, 11, 17))
_TOWER = VisionArgs(deepstack_layers=(8, 16, 24))


def _size(*shape: int, tower: VisionArgs, **rest) -> Qwen3VLArgs:
    text = dict(zip(_SHAPE, shape, strict=True))
    return Qwen3VLArgs(
        **text,
        vision=tower.with_updates(out_dim=text["dim"]),
        rope_theta=5_000_000.0,
        context_len=262144,
        **rest,
    )


def _moe(hidden_dim: int) -> dict:
    experts = MoEArgs(n_experts=128, top_k=8, hidden_dim=hidden_dim)
    return dict(moe=experts, moe_aux_loss_coeff=0.001)


# CPU-sized: Qwen3's debug model (head_dim 32: 16 rotated pairs) with a 2-block tower whose
# both blocks feed DeepStack; the ids of assets/tokenizer_vlm's vision tokens
_DEBUG = Qwen3VLArgs(
    dim=256,
    n_layers=4,
    n_heads=16,
    n_kv_heads=8,
    head_dim=32,
    ffn_hidden_dim=768,
    vocab_size=2053,  # assets/tokenizer_vlm's
    tie_word_embeddings=True,
    vision=VISION_DEBUG.with_updates(out_dim=256, deepstack_layers=(0, 1)),
    mrope_section=(6, 5, 5),
    vision_start_id=2050,
    vision_end_id=2051,
    image_token_id=2052,
)

QWEN3_VL_FLAVORS: dict[str, Qwen3VLArgs] = {
    "debugmodel": _DEBUG,
    "debugmodel_moe": replace(
        _DEBUG,
        tie_word_embeddings=False,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=128),
        moe_aux_loss_coeff=0.001,
    ),
    # dim, layers, heads, key-value heads, FFN width; tied embeddings up to 4B
    "2B": _size(2048, 28, 16, 8, 6144, tower=_TOWER_SMALL, tie_word_embeddings=True),
    "4B": _size(2560, 36, 32, 8, 9728, tower=_TOWER_SMALL, tie_word_embeddings=True),
    "8B": _size(4096, 36, 32, 8, 12288, tower=_TOWER),
    "32B": _size(5120, 64, 64, 8, 25600, tower=_TOWER),
    "30B-A3B": _size(2048, 48, 32, 4, 6144, tower=_TOWER, **_moe(768)),
    "235B-A22B": _size(4096, 94, 64, 4, 12288, tower=_TOWER, **_moe(1536)),
}
