"""Qwen3.5's text model (dense and MoE): the hybrid linear-attention decoder
(titan.models.common.hybrid_decoder) with Qwen3.5's flavors and hub layout."""

from titan.config.entry import register
from titan.models.common.hybrid_args import check_context_parallel_type
from titan.models.common.hybrid_decoder import HybridDecoder
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.qwen3_5.args import QWEN3_5_FLAVORS
from titan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter
from titan.models.spec import TrainSpec


class Qwen3_5(HybridDecoder):
    pass


def parallelize_qwen3_5(model, dims, job):
    # imported when a model is parallelized, not when the family registers: the launcher's
    # config check registers every family and needs none of DTensor/FSDP
    from titan.models.common.hybrid_parallelize import parallelize_hybrid

    return parallelize_hybrid(model, dims, job)


register(
    TrainSpec(
        name="qwen3_5",
        model_cls=Qwen3_5,
        flavors=QWEN3_5_FLAVORS,
        parallelize_fn=parallelize_qwen3_5,
        pipelining_fn=pipeline_decoder,
        plan_check=check_context_parallel_type,
        state_dict_adapter=Qwen3_5StateDictAdapter,
        post_optimizer_hooks=(moe_balance_hook,),
    )
)

__all__ = ["QWEN3_5_FLAVORS", "Qwen3_5", "Qwen3_5StateDictAdapter"]
