from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Transformer
from titan.models.llama3.parallelize import parallelize_llama
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from titan.models.spec import TrainSpec, register_train_spec
from titan.parallelisms.pipeline import stage_module

register_train_spec(TrainSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    parallelize_fn=parallelize_llama,
    pipelining_fn=stage_module,
    state_dict_adapter=Llama3StateDictAdapter,
))

__all__ = ["LLAMA3_FLAVORS", "Llama3Args", "Transformer", "Llama3StateDictAdapter"]
