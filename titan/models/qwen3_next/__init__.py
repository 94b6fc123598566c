"""Qwen3-Next: the hybrid linear-attention decoder (titan.models.common.hybrid_decoder) with
Qwen3-Next's flavors and hub layout."""

from titan.config.entry import register
from titan.models.common.family import HYBRID, decoder_family
from titan.models.common.hybrid_args import check_context_parallel_type
from titan.models.common.hybrid_decoder import HybridDecoder
from titan.models.qwen3_next.args import QWEN3_NEXT_FLAVORS
from titan.models.qwen3_next.state_dict_adapter import Qwen3NextStateDictAdapter


class Qwen3Next(HybridDecoder):
    pass


register(
    decoder_family(
        "qwen3_next",
        Qwen3Next,
        QWEN3_NEXT_FLAVORS,
        Qwen3NextStateDictAdapter,
        HYBRID,
        plan_check=check_context_parallel_type,
    )
)

__all__ = ["QWEN3_NEXT_FLAVORS", "Qwen3Next", "Qwen3NextStateDictAdapter"]
