"""The TrainSpec of a family built on the common decoder: one call per family instead of a
parallelize wrapper and a registration block each."""

from titan.config.plugins import load
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.common.pipeline import pipeline_decoder
from titan.models.spec import TrainSpec


class DecoderParallelize:
    """The common decoder's parallelisms with a family's attention and part plans, named
    "module:function": imported when a model is parallelized, not when the family registers
    (the launcher's config check registers every family and needs none of DTensor/FSDP)."""

    def __init__(self, attention_plan: str | None = None, part_plan: str | None = None):
        self.attention_plan, self.part_plan = attention_plan, part_plan

    def __call__(self, model, dims, job):
        from titan.models.common.parallelize import parallelize_decoder

        plans = {
            key: load(path)
            for key, path in (
                ("attention_plan", self.attention_plan),
                ("part_plan", self.part_plan),
            )
            if path
        }
        return parallelize_decoder(model, dims, job, **plans)


# the hybrid decoder's linear-attention mixers and gated shared experts
HYBRID = DecoderParallelize(
    "titan.models.common.hybrid_parallelize:mixer_plan",
    "titan.models.common.hybrid_parallelize:part_plan",
)


def decoder_family(
    name: str,
    model_cls: type,
    flavors: dict,
    adapter: type,
    parallelize: DecoderParallelize | None = None,
    **fields,
) -> TrainSpec:
    """A family on the common decoder: its parallelisms (`parallelize`: the plain decoder's
    without one), the common pipeline split and the MoE routing-bias update (a no-op for a
    dense flavor), unless `fields` say otherwise."""
    return TrainSpec(
        name=name,
        model_cls=model_cls,
        flavors=flavors,
        parallelize_fn=parallelize or DecoderParallelize(),
        **{
            "pipelining_fn": pipeline_decoder,
            "state_dict_adapter": adapter,
            "post_optimizer_hooks": (moe_balance_hook,),
            **fields,
        },
    )
