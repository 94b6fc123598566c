from titan.config import extensions
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.qwen3_next.args import QWEN3_NEXT_FLAVORS, Qwen3NextArgs
from titan.models.qwen3_next.model import Qwen3Next
from titan.models.qwen3_next.state_dict_adapter import Qwen3NextStateDictAdapter
from titan.models.spec import TrainSpec, register_train_spec


def parallelize_qwen3_next(model, dims, job):
    # imported when a model is parallelized: the launcher's config check registers every
    # family and needs none of DTensor/FSDP
    from titan.models.common.parallelize import parallelize_decoder
    from titan.models.qwen3_next.parallelize import mixer_plan, part_plan

    return parallelize_decoder(model, dims, job, attention_plan=mixer_plan, part_plan=part_plan)


def check_context_parallel_type(job, plan) -> None:
    """Gated DeltaNet under context parallelism runs whole sequences, 1/cp of the heads a
    rank: the hybrid type's all-to-all groups hold only part of each sequence."""
    from titan.config.manager import require

    par = job.parallelism
    require(
        job,
        plan.spec.name != "qwen3_next"
        or not plan.dims.cp_enabled
        or par.context_parallel_type != "hybrid",
        "parallelism.context_parallel_type",
        "Qwen3-Next's linear layers need each sequence whole in an all-to-all group; use "
        "'ring' or 'alltoall'",
    )


extensions.register_plan_check(check_context_parallel_type)

register_train_spec(
    TrainSpec(
        name="qwen3_next",
        model_cls=Qwen3Next,
        flavors=QWEN3_NEXT_FLAVORS,
        parallelize_fn=parallelize_qwen3_next,
        pipelining_fn=pipeline_decoder,
        state_dict_adapter=Qwen3NextStateDictAdapter,
        post_optimizer_hooks=(moe_balance_hook,),
    )
)

__all__ = ["QWEN3_NEXT_FLAVORS", "Qwen3NextArgs", "Qwen3Next", "Qwen3NextStateDictAdapter"]
