from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Transformer
from titan.models.llama3.pipeline import pipeline_llama
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from titan.models.spec import TrainSpec, register_train_spec


def parallelize_llama(model, dims, job):
    # imported when a model is parallelized, not when the family registers: the launcher's
    # config check registers every family and needs none of DTensor/FSDP (a second to import)
    from titan.models.llama3.parallelize import parallelize_llama

    return parallelize_llama(model, dims, job)


register_train_spec(TrainSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    parallelize_fn=parallelize_llama,
    pipelining_fn=pipeline_llama,
    state_dict_adapter=Llama3StateDictAdapter,
))

__all__ = ["LLAMA3_FLAVORS", "Llama3Args", "Transformer", "Llama3StateDictAdapter"]
