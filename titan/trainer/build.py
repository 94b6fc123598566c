"""The model parts of a run, on the meta device, as every rank builds them: the family's meta
model -> converters (float8, the chunked loss's output, LoRA) -> this rank's pipeline stages ->
parallelisms.

The trainer materializes and initializes them; the memory planner (titan.planner.memory) reads
their local shard shapes under a fake process group. One function for both keeps the plan's
parameter bytes equal to the run's.
"""

from torch import nn

from titan.components.lora.adapters import apply_lora
from titan.components.quantization.float8 import apply_float8
from titan.components.training.chunked_loss import apply_chunked_loss
from titan.config import JobConfig
from titan.parallelisms.pipeline import PipelinePlan
from titan.runtime.paths import resolve
from titan.trainer.run_plan import RunPlan


def converted_meta(job: JobConfig, plan: RunPlan) -> nn.Module:
    """The whole meta model with the converters that change its modules (float8, the chunked
    loss's output, LoRA's adapters): before any parallelism, as every rank builds it."""
    whole = plan.spec.build_meta(plan.model_args)
    if "float8" in job.model.converters:
        apply_float8(whole, job.float8)
    if job.training.loss_chunk_tokens:  # before the split: the last stage keeps the output
        apply_chunked_loss(whole, job.training.loss_chunk_tokens)
    if job.lora.rank:
        apply_lora(whole, job.lora)
    return whole


def meta_parts(
    job: JobConfig, plan: RunPlan
) -> tuple[nn.Module, list[nn.Module], PipelinePlan | None]:
    """(the whole meta model, this rank's parallelized parts, its pipeline plan or None).
    Needs plan.dims' mesh built."""
    spec, dims = plan.spec, plan.dims
    whole = converted_meta(job, plan)
    pp_plan = plan.pipeline(dims["pp"].get_local_rank()) if dims.pp_enabled else None
    parts = [whole]
    if pp_plan is not None:
        parts = [spec.pipelining_fn(whole, sid, pp_plan) for sid in pp_plan.stage_ids]
    return whole, [spec.parallelize_fn(part, dims, job) for part in parts], pp_plan


def run_identity(job: JobConfig, plan: RunPlan):
    """The model a run's checkpoints hold: the family's, and with LoRA its adapters."""
    from titan.components.checkpoint.identity import model_identity

    lora, ck = job.lora, job.checkpoint
    adapted = _saved_meta(job, plan) if lora.rank else None
    # the base the adapters train on: a resume must load the same one
    base = (
        {"path": str(resolve(ck.initial_load_path)), "hf": ck.initial_load_in_hf}
        if ck.initial_load_path
        else {"seed": job.training.seed}
    )
    settings = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": lora.target_modules,
        "base": base,
    }
    return model_identity(plan.spec, job.model.flavor, plan.model_args, adapted, settings)


def training_save_bytes(job: JobConfig, plan: RunPlan) -> int:
    """The size of one training checkpoint: the weights that train (all, or LoRA's adapters)
    and their optimizer state."""
    from titan.components.checkpoint.disk_space import model_save_bytes

    return model_save_bytes(
        _saved_meta(job, plan), job.optimizer, job.extensions, trained_only=bool(job.lora.rank)
    )


def _saved_meta(job: JobConfig, plan: RunPlan) -> nn.Module:
    """The meta model whose parameters a training checkpoint holds: the family's, with LoRA's
    adapters (the converters that keep the parameters, float8's and the chunked loss's, are
    not needed to know them)."""
    whole = plan.spec.build_meta(plan.model_args)
    if job.lora.rank:
        apply_lora(whole, job.lora)
    return whole
