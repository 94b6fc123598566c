"""Qwen3-VL: Qwen3's text model (titan.models.common.qwen3_decoder) behind the vision tower of
titan.models.common.vision_language, with its flavors and hub layout."""

from titan.config.entry import register
from titan.models.common.family import decoder_family
from titan.models.common.qwen3_decoder import Qwen3
from titan.models.common.vision_args import check_deepstack_stage
from titan.models.common.vision_language import VisionLanguage
from titan.models.qwen3_vl.args import QWEN3_VL_FLAVORS, Qwen3VLArgs
from titan.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter


class Qwen3VL(VisionLanguage, Qwen3):
    pass


register(
    decoder_family(
        "qwen3_vl",
        Qwen3VL,
        QWEN3_VL_FLAVORS,
        Qwen3VLStateDictAdapter,
        plan_check=check_deepstack_stage,
    )
)

__all__ = ["QWEN3_VL_FLAVORS", "Qwen3VL", "Qwen3VLArgs", "Qwen3VLStateDictAdapter"]
