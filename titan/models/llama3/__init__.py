from titan.config.entry import register
from titan.models.common.family import decoder_family
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Transformer
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

register(decoder_family("llama3", Transformer, LLAMA3_FLAVORS, Llama3StateDictAdapter))

__all__ = ["LLAMA3_FLAVORS", "Llama3Args", "Transformer", "Llama3StateDictAdapter"]
