from titan.config.entry import register
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from titan.models.gpt_oss.model import GptOss
from titan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from titan.models.spec import TrainSpec


def parallelize_gpt_oss(model, dims, job):
    # imported when a model is parallelized: the launcher's config check registers every
    # family and needs none of DTensor/FSDP
    from titan.models.common.parallelize import parallelize_decoder
    from titan.models.gpt_oss.parallelize import sink_attention_plan

    return parallelize_decoder(model, dims, job, attention_plan=sink_attention_plan)


register(
    TrainSpec(
        name="gpt_oss",
        model_cls=GptOss,
        flavors=GPT_OSS_FLAVORS,
        parallelize_fn=parallelize_gpt_oss,
        pipelining_fn=pipeline_decoder,
        state_dict_adapter=GptOssStateDictAdapter,
        post_optimizer_hooks=(moe_balance_hook,),
    )
)

__all__ = ["GPT_OSS_FLAVORS", "GptOssArgs", "GptOss", "GptOssStateDictAdapter"]
