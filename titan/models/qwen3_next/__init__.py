"""Qwen3-Next: the hybrid linear-attention decoder (titan.models.common.hybrid_decoder) with
Qwen3-Next's flavors and hub layout."""

from titan.config.entry import register
from titan.models.common.hybrid_args import check_context_parallel_type
from titan.models.common.hybrid_decoder import HybridDecoder
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.qwen3_next.args import QWEN3_NEXT_FLAVORS
from titan.models.qwen3_next.state_dict_adapter import Qwen3NextStateDictAdapter
from titan.models.spec import TrainSpec


class Qwen3Next(HybridDecoder):
    pass


def parallelize_qwen3_next(model, dims, job):
    # imported when a model is parallelized, not when the family registers: the launcher's
    # config check registers every family and needs none of DTensor/FSDP
    from titan.models.common.hybrid_parallelize import parallelize_hybrid

    return parallelize_hybrid(model, dims, job)


register(
    TrainSpec(
        name="qwen3_next",
        model_cls=Qwen3Next,
        flavors=QWEN3_NEXT_FLAVORS,
        parallelize_fn=parallelize_qwen3_next,
        pipelining_fn=pipeline_decoder,
        plan_check=check_context_parallel_type,
        state_dict_adapter=Qwen3NextStateDictAdapter,
        post_optimizer_hooks=(moe_balance_hook,),
    )
)

__all__ = ["QWEN3_NEXT_FLAVORS", "Qwen3Next", "Qwen3NextStateDictAdapter"]
