from titan.config.entry import register
from titan.models.common.family import decoder_family
from titan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titan.models.qwen3.model import Qwen3
from titan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

register(decoder_family("qwen3", Qwen3, QWEN3_FLAVORS, Qwen3StateDictAdapter))

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Qwen3", "Qwen3StateDictAdapter"]
