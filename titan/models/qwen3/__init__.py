from titan.config.entry import register
from titan.models.common.family import decoder_family
from titan.models.common.qwen3_args import QWEN3_FLAVORS, Qwen3Args
from titan.models.common.qwen3_decoder import Qwen3
from titan.models.common.qwen3_hf import Qwen3StateDictAdapter

register(decoder_family("qwen3", Qwen3, QWEN3_FLAVORS, Qwen3StateDictAdapter))

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Qwen3", "Qwen3StateDictAdapter"]
