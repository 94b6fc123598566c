"""The model parts of a run, on the meta device, as every rank builds them: the family's meta
model -> the model converters (titan.components.converters) -> this rank's pipeline stages ->
parallelisms.

The trainer materializes and initializes them; the memory planner (titan.planner.memory) reads
their local shard shapes under a fake process group. One function for both keeps the plan's
parameter bytes equal to the run's. This is where a run assembles its converters; nothing
else in the trainer names one.
"""

from torch import nn

from titan.components.converters import Converters
from titan.config import JobConfig
from titan.parallelisms.pipeline import PipelinePlan
from titan.plan.run_plan import RunPlan
from titan.runtime.paths import resolve


def converted_meta(
    job: JobConfig, plan: RunPlan, converters: Converters | None = None
) -> nn.Module:
    """The whole meta model with every enabled converter applied: before any parallelism, as
    every rank builds it."""
    whole = plan.spec.build_meta(plan.model_args)
    (converters or Converters(job)).convert(whole)
    return whole


def meta_parts(
    job: JobConfig, plan: RunPlan, converters: Converters | None = None
) -> tuple[nn.Module, list[nn.Module], PipelinePlan | None]:
    """(the whole meta model, this rank's parallelized parts, its pipeline plan or None).
    Needs plan.dims' mesh built."""
    spec, dims = plan.spec, plan.dims
    whole = converted_meta(job, plan, converters)
    pp_plan = plan.pipeline(dims["pp"].get_local_rank()) if dims.pp_enabled else None
    parts = [whole]
    if pp_plan is not None:
        parts = [spec.pipelining_fn(whole, sid, pp_plan) for sid in pp_plan.stage_ids]
    return whole, [spec.parallelize_fn(part, dims, job) for part in parts], pp_plan


def run_identity(job: JobConfig, plan: RunPlan, converters: Converters | None = None):
    """The model a run's checkpoints hold: the family's, and when a converter keeps only its
    own parameters in them (adapters), those with its settings and the base they train on."""
    from titan.components.checkpoint.identity import model_identity

    converters = converters or Converters(job)
    if converters.partial is None:
        return model_identity(plan.spec, job.model.flavor, plan.model_args, None, {})
    ck = job.checkpoint
    # the base the trained parameters start from: a resume must load the same one
    base = (
        {"path": str(resolve(ck.initial_load_path)), "hf": ck.initial_load_in_hf}
        if ck.initial_load_path
        else {"seed": job.training.seed}
    )
    settings = {**converters.identity(), "base": base}
    saved = _saved_meta(plan, converters)
    return model_identity(plan.spec, job.model.flavor, plan.model_args, saved, settings)


def training_save_bytes(job: JobConfig, plan: RunPlan, converters: Converters | None = None) -> int:
    """The size of one training checkpoint: the weights that train (all, or only those a
    converter keeps) and their optimizer state."""
    from titan.components.checkpoint.disk_space import model_save_bytes

    converters = converters or Converters(job)
    return model_save_bytes(
        _saved_meta(plan, converters),
        job.optimizer,
        job.extensions,
        trained_only=converters.partial is not None,
    )


def _saved_meta(plan: RunPlan, converters: Converters) -> nn.Module:
    """The meta model whose parameters a training checkpoint holds: the family's, converted by
    those that add parameters (the others keep the family's parameters)."""
    return converters.saved(plan.spec.build_meta(plan.model_args))
