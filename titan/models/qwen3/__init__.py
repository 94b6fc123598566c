from titan.config.entry import register
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titan.models.qwen3.model import Qwen3
from titan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from titan.models.spec import TrainSpec


def parallelize_qwen3(model, dims, job):
    # imported when a model is parallelized: the launcher's config check registers every
    # family and needs none of DTensor/FSDP
    from titan.models.common.parallelize import parallelize_decoder

    return parallelize_decoder(model, dims, job)


register(
    TrainSpec(
        name="qwen3",
        model_cls=Qwen3,
        flavors=QWEN3_FLAVORS,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_decoder,
        state_dict_adapter=Qwen3StateDictAdapter,
        post_optimizer_hooks=(moe_balance_hook,),
    )
)

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Qwen3", "Qwen3StateDictAdapter"]
