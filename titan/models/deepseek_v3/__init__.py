from titan.config.entry import register
from titan.models.common.family import DecoderParallelize, decoder_family
from titan.models.common.pipeline import pipeline_decoder
from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from titan.models.deepseek_v3.model import DeepSeekV3
from titan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

_PLANS = "titan.models.deepseek_v3.parallelize"


def pipeline_deepseek_v3(whole, stage_id, plan):
    """The common split (the prediction depths go to the last stage), their copy of the
    embedding with them."""
    stage = pipeline_decoder(whole, stage_id, plan)
    if stage_id != plan.num_stages - 1:
        stage.mtp_embeddings = None
    return stage


register(
    decoder_family(
        "deepseek_v3",
        DeepSeekV3,
        DEEPSEEK_V3_FLAVORS,
        DeepSeekV3StateDictAdapter,
        DecoderParallelize(f"{_PLANS}:mla_plan", f"{_PLANS}:mtp_plan"),
        pipelining_fn=pipeline_deepseek_v3,
    )
)

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "DeepSeekV3", "DeepSeekV3StateDictAdapter"]
