"""Qwen3.5 (dense and MoE): the hybrid linear-attention decoder
(titan.models.common.hybrid_decoder), with the vision tower of
titan.models.common.vision_language in its `-vision` flavors; Qwen3.5's flavors and hub
layouts."""

from titan.config.entry import register
from titan.models.common.family import HYBRID, decoder_family
from titan.models.common.hybrid_args import check_context_parallel_type
from titan.models.common.hybrid_decoder import HybridDecoder
from titan.models.common.vision_language import VisionLanguage
from titan.models.qwen3_5.args import QWEN3_5_FLAVORS
from titan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter


class Qwen3_5(VisionLanguage, HybridDecoder):
    pass


register(
    decoder_family(
        "qwen3_5",
        Qwen3_5,
        QWEN3_5_FLAVORS,
        Qwen3_5StateDictAdapter,
        HYBRID,
        plan_check=check_context_parallel_type,
    )
)

__all__ = ["QWEN3_5_FLAVORS", "Qwen3_5", "Qwen3_5StateDictAdapter"]
