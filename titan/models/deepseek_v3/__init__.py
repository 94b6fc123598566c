from titan.config.entry import register
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from titan.models.deepseek_v3.model import DeepSeekV3
from titan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from titan.models.spec import TrainSpec


def parallelize_deepseek_v3(model, dims, job):
    # imported when a model is parallelized: the launcher's config check registers every
    # family and needs none of DTensor/FSDP
    from titan.models.common.parallelize import parallelize_decoder
    from titan.models.deepseek_v3.parallelize import mla_plan, mtp_plan

    return parallelize_decoder(model, dims, job, attention_plan=mla_plan, part_plan=mtp_plan)


def pipeline_deepseek_v3(whole, stage_id, plan):
    """The common split (the prediction depths go to the last stage), their copy of the
    embedding with them."""
    stage = pipeline_decoder(whole, stage_id, plan)
    if stage_id != plan.num_stages - 1:
        stage.mtp_embeddings = None
    return stage


register(
    TrainSpec(
        name="deepseek_v3",
        model_cls=DeepSeekV3,
        flavors=DEEPSEEK_V3_FLAVORS,
        parallelize_fn=parallelize_deepseek_v3,
        pipelining_fn=pipeline_deepseek_v3,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        post_optimizer_hooks=(moe_balance_hook,),
    )
)

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "DeepSeekV3", "DeepSeekV3StateDictAdapter"]
