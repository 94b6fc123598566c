from titan.config.entry import register
from titan.models.common.family import DecoderParallelize, decoder_family
from titan.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from titan.models.gpt_oss.model import GptOss
from titan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

register(
    decoder_family(
        "gpt_oss",
        GptOss,
        GPT_OSS_FLAVORS,
        GptOssStateDictAdapter,
        DecoderParallelize("titan.models.gpt_oss.parallelize:sink_attention_plan"),
    )
)

__all__ = ["GPT_OSS_FLAVORS", "GptOssArgs", "GptOss", "GptOssStateDictAdapter"]
