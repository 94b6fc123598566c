"""The model parts of a run, on the meta device, as every rank builds them: the family's meta
model -> the model converters (titan.components.converters) -> this rank's pipeline stages ->
parallelisms.

The trainer materializes and initializes them; the memory planner (titan.planner.memory) reads
their local shard shapes under a fake process group. One function for both keeps the plan's
parameter bytes equal to the run's. This is where a run assembles its converters; nothing
else in the trainer names one.
"""

import logging

from torch import nn

from titan.components.converters import Converters
from titan.components.data.dataloader import DataShard
from titan.components.observability.metrics import MetricsLogger
from titan.config import JobConfig
from titan.parallelisms.pipeline import PipelinePlan
from titan.plan.run_plan import RunPlan
from titan.runtime.console import plural
from titan.runtime.paths import resolve

logger = logging.getLogger("titan")


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


def data_shard(job: JobConfig, plan: RunPlan) -> DataShard:
    """This rank's slice of each global batch; torchft groups extend the dp dimension."""
    ft = job.fault_tolerance
    group = ft.replica_id if ft.enable else 0
    dp_mesh = plan.dims["dp"]
    return DataShard(group * dp_mesh.size() + dp_mesh.get_local_rank(), plan.data_parallel_size)


def materialized_parts(job: JobConfig, plan: RunPlan, converters: Converters, device):
    """(this rank's model parts on `device`, initialized; its pipeline plan or None; the
    pipeline copies of a tied weight or None): meta model -> stages -> parallelisms -> real
    memory -> weights from (seed, parameter name), identical whatever the layout."""
    whole, parts, pp_plan = meta_parts(job, plan, converters)
    for part in parts:
        part.to_empty(device=device)
        part.init_weights(job.training.seed, buffer_device=device)
        converters.init_weights(part, job.training.seed)
        part.train()
    tied = None
    if pp_plan is not None and whole.tied_parameters():
        from titan.parallelisms.tied_weights import TiedCopies

        split = pp_plan.num_stages - 1 not in plan.pipeline(0).stage_ids
        tied = TiedCopies(parts, whole.tied_parameters(), plan.dims.world_mesh, split)
    return parts, pp_plan, tied


def describe(job: JobConfig, plan: RunPlan, pp: PipelinePlan | None, converters, parts) -> None:
    """The run's model, layout and converters, logged before it trains."""
    args = plan.model_args
    active = args.num_params(active=True)
    logger.info(
        "model %s %s: %.3fM parameters%s, layout %s, grad accumulation %d%s",
        job.model.name,
        job.model.flavor,
        args.num_params() / 1e6,
        f" ({active / 1e6:.3f}M active)" if active != args.num_params() else "",
        plan.dims,
        plan.grad_accum_steps,
        f", pipeline stages {pp.stage_ids} of {pp.num_stages} "
        f"({pp.schedule}, {pp.n_microbatches} microbatches)"
        if pp
        else "",
    )
    converters.describe(parts, pipelined=pp is not None)


def describe_batches(job: JobConfig, plan: RunPlan) -> None:
    """The run's steps and batches (and their schedules), logged as training starts."""
    if job.job.description:
        logger.info("job: %s", job.job.description)
    t, schedule, lengths = job.training, plan.batch_schedule, plan.seq_len_schedule
    logger.info(
        "training %s, global batch %d sequences x %d tokens%s%s",
        plural(t.steps, "step"),
        plan.global_batch_size,
        t.seq_len,
        f" (scheduled: {', '.join(f'{s} from step {a}' for a, s in schedule.entries)}; "
        f"lr scaling {schedule.lr_scaling})"
        if schedule
        else "",
        f"; sequence lengths {', '.join(f'{n} from step {a}' for a, n in lengths.entries)}"
        f" (a step keeps its {lengths.keeps})"
        if lengths
        else "",
    )


def post_optimizer_hooks(job: JobConfig, plan: RunPlan, converters: Converters, parts) -> list:
    """Run after every step, in order, told whether the optimizer stepped: the converters'
    (scales of the new weights, say), then the family's (an MoE's router-bias update)."""
    family = (make(parts, job) for make in plan.spec.post_optimizer_hooks)
    return converters.post_optimizer_hooks(parts) + [h for h in family if h]


def lr_scheduler(job: JobConfig, plan: RunPlan, optimizer):
    from titan.components.optim.lr_scheduler import build_lr_scheduler

    schedule = plan.batch_schedule
    return build_lr_scheduler(
        optimizer,
        job.lr_scheduler,
        job.training.steps,
        scale=schedule.lr_factor if schedule and schedule.lr_scaling != "none" else None,
    )


def checkpointer(
    job: JobConfig, plan: RunPlan, converters: Converters, rank: int, parts, states, faults
):
    """The run's Checkpointer over `states` (name -> stateful) of the model `parts`."""
    from titan.components.checkpoint.checkpointer import Checkpointer
    from titan.components.checkpoint.hf_io import HFModelIO
    from titan.components.checkpoint.trained_with import trained_with

    return Checkpointer(
        job.checkpoint,
        dump_folder=job.job.dump_folder,
        rank=rank,
        layout=plan.layout(),
        identity=run_identity(job, plan, converters),
        save_bytes=training_save_bytes(job, plan, converters),
        states=states,
        hf=HFModelIO(
            plan.spec, plan.model_args, plan.tokenizer, hf_source(job), processor_of(job, plan)
        )
        if plan.spec.state_dict_adapter
        else None,
        on_save_phase=faults.on_checkpoint_phase if faults else None,
        on_export=converters.exporter(parts, plan.spec, plan.model_args),
        trained_with=trained_with(job.optimizer.name, plan.tokenizer, converters.parametrization()),
    )


def metrics_logger(job: JobConfig, plan: RunPlan, device) -> MetricsLogger:
    from titan.components.observability.flops import peak_flops
    from titan.runtime.distributed import max_over_ranks
    from titan.runtime.dtypes import to_dtype

    m, t = job.metrics, job.training
    peak, peak_source = peak_flops(device, to_dtype(t.mixed_precision_param), m.peak_flops)
    if peak is None:
        logger.info("MFU %s", peak_source)
    else:
        logger.info("MFU is relative to %.4g TFLOP/s (%s)", peak / 1e12, peak_source)
    return MetricsLogger(
        m,
        device=device,
        flops_per_token=plan.model_args.flops_per_token(t.seq_len),
        peak_flops=peak,
        max_over_ranks=lambda value: max_over_ranks(value, device),
        total_steps=t.steps,
    )


def fault_tolerance(job: JobConfig, device, parts, states: dict, on_heal):
    """torchft's replica groups (None where fault_tolerance is off): gradients averaged over
    the groups, `states` given to a healing peer, `on_heal` called after a heal."""
    if not job.fault_tolerance.enable:
        return None
    from titan.components.fault_tolerance.torchft_groups import FaultTolerance

    ft = FaultTolerance(job.fault_tolerance, device=device)
    ft.average_gradients_across_groups(parts)
    ft.register_state(states, on_heal=on_heal)
    return ft


def process(job: JobConfig, plan: RunPlan):
    """(device, rank, world size) of this process, its process group and mesh made, its
    random state seeded and determinism set."""
    from titan.assembly.determinism import set_determinism
    from titan.components.observability.flight_recorder import configure_flight_recorder
    from titan.runtime.distributed import init_distributed, pick_device

    t, dims = job.training, plan.dims
    device = pick_device(t.device)
    keep_step = job.metrics.per_rank and dims.world_size > 1
    configure_flight_recorder(job.comm, job.job.dump_folder, device.type, keep_step)
    rank, world_size = init_distributed(device, job.comm.init_timeout_seconds)
    set_determinism(t.seed, t.deterministic, compiling=job.compile.enable)
    dims.build_mesh(device.type)
    return device, rank, world_size


def fault_injector(job: JobConfig, plan: RunPlan, rank: int, shard: DataShard, parts, step):
    """The debug section's injected faults, installed in the model `parts` (None where none
    is set); `step()` is the step the run is in."""
    from titan.components.fault_tolerance.injection import FaultInjector

    faults = FaultInjector.build(
        job.debug,
        rank=rank,
        current_step=step,
        vocab_size=plan.model_args.vocab_size,
        first_sample=shard.dp_rank * (plan.global_batch_size // plan.data_parallel_size),
        bos_id=plan.tokenizer.bos_id,
    )
    if faults is not None:
        faults.install(parts)
    return faults


def dataloader(job: JobConfig, plan: RunPlan, shard: DataShard):
    from titan.components.data.dataloader import build_dataloader

    return build_dataloader(
        job.training,
        tokenizer=plan.tokenizer,
        shard=shard,
        global_batch_size=plan.global_batch_size,
        sections=job.extensions,
        model_args=plan.model_args,
    )


def watchdog(job: JobConfig, rank: int):
    """The step watchdog, at 80% of the collective timeout: a stuck rank reports itself
    before its peers' collectives time out (they only know that *someone* is late)."""
    from titan.components.fault_tolerance.watchdog import StepWatchdog

    return StepWatchdog(0.8 * job.comm.train_timeout_seconds, rank, job.job.dump_folder)


def steady_state(job: JobConfig, watchdog) -> None:
    """After the first step: the collective timeout shortened to the steady steps' and the
    watchdog started."""
    from titan.runtime.distributed import set_collective_timeout

    timeout = job.comm.train_timeout_seconds
    set_collective_timeout(timeout)
    logger.info("collective timeout now %ds (comm.train_timeout_seconds)", timeout)
    watchdog.start()


def processor_of(job: JobConfig, plan: RunPlan):
    """The image rule a vision-language model trains with (None: a text model)."""
    vision = getattr(plan.model_args, "vision", None)
    if vision is None:
        return None
    from titan.components.data.image_text import image_rule

    return image_rule(vision, job.extensions.get("images"))


def hf_source(job: JobConfig) -> dict | None:
    """The config.json of the HF model a run starts from (None: it starts from no HF
    folder): its exports keep the fields they do not change."""
    from titan.components.checkpoint.hf_io import read_hf_config

    ck = job.checkpoint
    if not (ck.initial_load_in_hf and ck.initial_load_path):
        return None
    return read_hf_config(resolve(ck.initial_load_path))
