from titan.config.entry import register
from titan.models.common.pipeline import pipeline_decoder
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Transformer
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from titan.models.spec import TrainSpec


def parallelize_llama(model, dims, job):
    # imported when a model is parallelized, not when the family registers: the launcher's
    # config check registers every family and needs none of DTensor/FSDP (a second to import)
    from titan.models.common.parallelize import parallelize_decoder

    return parallelize_decoder(model, dims, job)


register(
    TrainSpec(
        name="llama3",
        model_cls=Transformer,
        flavors=LLAMA3_FLAVORS,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_decoder,
        state_dict_adapter=Llama3StateDictAdapter,
    )
)

__all__ = ["LLAMA3_FLAVORS", "Llama3Args", "Transformer", "Llama3StateDictAdapter"]
