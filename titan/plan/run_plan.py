"""Everything that can be checked before a process group, a folder or a file exists.

The launcher runs it once (so a bad run fails in a second with exit code 2 instead of
after torchrun starts N workers); each worker runs it again, as workers may be started
by other launchers.
"""

import dataclasses
import logging
import os
from dataclasses import dataclass, fields, is_dataclass

from titan.components.data.tokenizer import Tokenizer, TokenizerError
from titan.config import ConfigError, JobConfig, extensions
from titan.config.family_options import options_of
from titan.config.manager import require, source_of
from titan.models.spec import ModelArgs, TrainSpec, get_train_spec, registered_names
from titan.parallelisms.parallel_dims import (
    ParallelDims,
    ParallelismError,
    heads_group_size,
    validate_against_model,
)
from titan.parallelisms.pipeline import PipelineConfigError, PipelinePlan, plan_pipelines
from titan.plan.batch_schedule import BatchSchedule, parse_schedule
from titan.plan.seq_len_schedule import (
    SeqLenSchedule,
    StepShape,
    change_steps,
    parse_seq_len_schedule,
)
from titan.runtime.paths import resolve

logger = logging.getLogger(__name__)


@dataclass
class RunPlan:
    spec: TrainSpec
    model_args: ModelArgs
    dims: ParallelDims
    tokenizer: Tokenizer | None  # None: planning only, the configured tokenizer is missing
    global_batch_size: int
    grad_accum_steps: int
    # data-parallel replicas in all: the mesh's dp times torchft replica groups
    data_parallel_size: int
    device: str  # "cuda" or "cpu"
    # every pipeline rank's stages (index: pp rank), for training batches and for validation
    # batches (same stages, as many microbatches as a validation batch holds); empty without
    # pipelining, and validation's without validation
    pipelines: tuple[PipelinePlan, ...] = ()
    validation_pipelines: tuple[PipelinePlan, ...] = ()
    # sequences per validation batch over all dp ranks, and per forward on one rank
    validation_global_batch: int = 0
    validation_local_batch: int = 0
    # training.global_batch_schedule resolved (None: every step global_batch_size)
    batch_schedule: BatchSchedule | None = None
    seq_len: int = 0  # training.seq_len
    # training.seq_len_schedule resolved (None: every step seq_len)
    seq_len_schedule: SeqLenSchedule | None = None

    def global_batch_at(self, step: int) -> int:
        """The global batch size of (1-based) step `step`."""
        return self.batch_schedule.size_at(step) if self.batch_schedule else self.global_batch_size

    def grad_accum_at(self, step: int) -> int:
        """Microbatches of step `step` on each data-parallel rank."""
        per_step = self.global_batch_size // self.grad_accum_steps
        return self.global_batch_at(step) // per_step

    def step_shape(self, step: int) -> StepShape:
        """What (1-based) step `step` trains on: its sequences' length and number, its
        microbatches, and the training.seq_len windows it takes from the data stream."""
        windows = self.global_batch_at(step)
        local = self.global_batch_size // self.grad_accum_steps // self.data_parallel_size
        accum = self.grad_accum_at(step)
        if self.seq_len_schedule is None:
            return StepShape(self.seq_len, windows, local, accum, windows, 1)
        return self.seq_len_schedule.shape(windows, local, accum, step)

    def pipeline(self, pp_rank: int, validation: bool = False) -> PipelinePlan | None:
        """Pipeline rank `pp_rank`'s stages; None without pipelining."""
        plans = self.validation_pipelines if validation else self.pipelines
        return plans[pp_rank] if plans else None

    def layout(self) -> dict:
        """The parallel layout, as checkpoints record it."""
        return {
            "world_size": self.dims.world_size,
            **self.dims.degrees(),
            "grad_accum_steps": self.grad_accum_steps,
            "global_batch_size": self.global_batch_size,
        }


def plan_run(
    job: JobConfig, world_size: int | None = None, tokenizer: Tokenizer | None = None
) -> RunPlan:
    """Resolve model, tokenizer and parallel layout; raise ConfigError on any problem.

    Once per process and job: every part of a run reads the plan, not the config again.
    `tokenizer`: the job's, when the caller has read it already (the same job at another
    world size or layout); read here otherwise."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    m, t = job.model, job.training
    try:
        spec = get_train_spec(m.name)
    except KeyError:
        raise ConfigError(
            f"model.name = {m.name!r} is not a registered model; choose one of "
            f"{', '.join(registered_names())}"
        ) from None
    require(
        job,
        m.flavor in spec.flavors or m.flavor == FROM_HF,
        "model.flavor",
        f"{m.name} has flavors {', '.join(spec.flavors)}, or '{FROM_HF}' (the shape of "
        "the HF model in checkpoint.initial_load_path)",
    )
    device = device_type(job)
    if tokenizer is None:
        tokenizer = load_tokenizer(job)
    model_args = resolve_model_args(job, spec, tokenizer)
    try:
        dims = ParallelDims.from_config(job, world_size)
        ft = job.fault_tolerance
        dp_size = dims.dp * (ft.group_size if ft.enable else 1)
        global_batch = (
            t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp_size
        )
        validate_against_model(
            dims,
            model_args,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=global_batch,
            dp_size=dp_size,
            cp_load_balance=job.parallelism.context_parallel_load_balance,
        )
    except ParallelismError as e:
        raise ConfigError(f"parallelism: {e}") from None
    cp_type = job.parallelism.context_parallel_type
    if dims.cp_enabled and cp_type == "hybrid":
        a = job.parallelism.context_parallel_alltoall_degree
        require(
            job,
            1 < a < dims.cp and dims.cp % a == 0,
            "parallelism.context_parallel_alltoall_degree",
            f"{a}: the hybrid's all-to-all groups must split cp {dims.cp} into groups of "
            "more than 1 rank and fewer than cp (cp itself is 'alltoall', 1 is 'ring')",
        )
    a = heads_group_size(job.parallelism, dims.cp)
    if dims.cp_enabled and a:
        heads = {"heads": model_args.n_heads, "kv heads": getattr(model_args, "n_kv_heads", None)}
        for name, n in heads.items():
            require(
                job,
                not n or n % (dims.tp * a) == 0,
                "parallelism.context_parallel_type",
                f"{cp_type!r} splits each TP rank's {name} over {a} ranks: model {m.name} "
                f"{m.flavor} has {n} {name}, which tp {dims.tp} x {a} does not divide; "
                "use 'ring', or a cp (and tp) that divides them",
            )
    problems = model_args.layout_problems(dims)
    if problems:
        raise ConfigError(f"parallelism: model {m.name} {m.flavor}: {'; '.join(problems)}")
    if dims.cp_enabled:
        from titan.parallelisms.context_parallel import check_torch_version

        try:
            check_torch_version(device)
        except RuntimeError as e:
            raise ConfigError(f"parallelism.context_parallel_degree = {dims.cp}: {e}") from None
    pipelines = validation_pipelines = ()
    val_global, val_local = validation_batches(job, dp_size) if job.validation.enable else (0, 0)
    if dims.pp_enabled:
        require(
            job,
            spec.pipelining_fn is not None,
            "parallelism.pipeline_parallel_degree",
            f"model {m.name} registers no pipeline split function",
        )
        pipelines = pipeline_plans(job, model_args)
        if job.validation.enable:
            validation_pipelines = pipeline_plans(job, model_args, validation_batch=val_local)
    grad_accum = global_batch // (t.local_batch_size * dp_size)
    check_moe(job, spec, model_args, dims, grad_accum)
    schedule = None
    require(
        job,
        t.batch_lr_scaling == "none" or bool(t.global_batch_schedule),
        "training.batch_lr_scaling",
        "scales the lr of scheduled batch sizes, and training.global_batch_schedule is empty: "
        "set the schedule, or leave batch_lr_scaling = 'none'",
    )
    if t.global_batch_schedule:
        schedule = parse_schedule(job, global_batch, t.local_batch_size * dp_size)
        for size in schedule.sizes():
            check_moe(job, spec, model_args, dims, size // (t.local_batch_size * dp_size))
        require(
            job,
            not job.fault_tolerance.enable,
            "training.global_batch_schedule",
            "is not yet supported with fault_tolerance.enable (a heal seeks steps of one size)",
        )
        require(
            job,
            not t.dataset_streaming,
            "training.global_batch_schedule",
            "needs a local dataset without training.dataset_streaming (a streamed one cannot "
            "regroup its batches)",
        )
    lengths = None
    if t.seq_len_schedule:
        lengths = parse_seq_len_schedule(job)
        check_seq_len_schedule(job, lengths, schedule, dims, model_args, global_batch, dp_size)
    if job.training.enable_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError("training.enable_cpu_offload needs FSDP (data_parallel_shard_degree > 1)")
    plan = RunPlan(
        spec,
        model_args,
        dims,
        tokenizer,
        global_batch,
        grad_accum,
        dp_size,
        device,
        pipelines,
        validation_pipelines,
        val_global,
        val_local,
        batch_schedule=schedule,
        seq_len=t.seq_len,
        seq_len_schedule=lengths,
    )
    # the components' own: data, checkpoints, converters, torchft, profiling, ...
    for check in extensions.plan_checks():
        check(job, plan)
    return plan


def check_seq_len_schedule(
    job: JobConfig,
    lengths: SeqLenSchedule,
    batches: BatchSchedule | None,
    dims: ParallelDims,
    model_args: ModelArgs,
    global_batch: int,
    dp_size: int,
) -> None:
    """Each step's shape under training.seq_len_schedule fits the layout and the data."""
    t, key = job.training, "training.seq_len_schedule"
    require(
        job,
        t.dataset_format == "text" and not t.dataset_streaming,
        key,
        "needs packed text read indexed (training.dataset_format = 'text' without "
        "dataset_streaming): a shorter window is a piece of a training.seq_len window",
    )
    require(
        job,
        not job.fault_tolerance.enable,
        key,
        "is not yet supported with fault_tolerance.enable (a heal seeks steps of one shape)",
    )
    for step in change_steps(lengths, batches):
        size = batches.size_at(step) if batches else global_batch
        length = lengths.length_at(step)
        n = t.seq_len // length
        require(
            job,
            lengths.keeps == "tokens" or size % n == 0,
            key,
            f"step {step} trains {size} sequences of {length} tokens with "
            "seq_len_schedule_keeps = 'sequences', which is not a whole number of "
            f"training.seq_len = {t.seq_len} windows ({size} x {length} / {t.seq_len}); use a "
            f"global batch size a multiple of {n}, or seq_len_schedule_keeps = 'tokens'",
        )
        local = t.local_batch_size * (n if lengths.keeps == "tokens" else 1)
        try:
            validate_against_model(
                dims,
                model_args,
                seq_len=length,
                local_batch_size=local,
                global_batch_size=local * dp_size,
                dp_size=dp_size,
                cp_load_balance=job.parallelism.context_parallel_load_balance,
            )
        except ParallelismError as e:
            raise ConfigError(f"{key}: step {step} at {length} tokens: {e}") from None


def check_moe(
    job: JobConfig, spec: TrainSpec, args: ModelArgs, dims: ParallelDims, grad_accum: int
) -> None:
    """What an MoE model cannot combine with, named before launch."""
    moe = args.moe_args()
    require(
        job,
        moe is not None or not dims.ep_enabled,
        "parallelism.expert_parallel_degree",
        f"expert parallelism splits an MoE's routed experts, but {spec.name} "
        f"{job.model.flavor} has none: set it to 1",
    )
    if moe is None:
        return
    if dims.ep_enabled:
        check_expert_parallel(job, moe, dims)
    ck = job.checkpoint
    adapter = spec.state_dict_adapter
    if ck.last_save_in_hf and adapter is not None:
        problems = adapter.export_problems(args)
        require(job, not problems, "checkpoint.last_save_in_hf", "; ".join(problems))
    require(
        job,
        not (job.compile.enable and dims.tp_enabled),
        "compile.enable",
        "an MoE model under tensor parallelism runs eagerly: its router and routed "
        "experts swap in local weights per forward, which torch.compile does not trace. "
        "Disable compile or tensor parallelism",
    )
    if moe.aux_loss != "none" and moe.aux_loss_coeff and moe.aux_loss_scope == "global_batch":
        check_global_batch_scope(job, spec.name, dims, grad_accum)
    rate = moe.bias_update_rate
    require(
        job,
        not (rate and job.fault_tolerance.enable),
        "fault_tolerance.enable",
        f"the routing-bias update ({spec.name}.moe_bias_update_rate = {rate}) sums expert "
        "loads over this replica group only, so groups would route differently: set the "
        "rate to 0 under torchft",
    )


def check_global_batch_scope(
    job: JobConfig, family: str, dims: ParallelDims, grad_accum: int
) -> None:
    """A balancing loss over the whole global batch needs every expert's count of the batch
    before any backward: each rank's step must be one forward."""
    key = f"{family}.moe_aux_loss_scope"
    why = "one loss term over the whole global batch needs each rank's step in one forward, but "
    require(
        job,
        grad_accum == 1,
        key,
        why + f"gradient accumulation splits it into "
        f"{grad_accum} (training.global_batch_size / (local_batch_size x dp)): set "
        f"training.local_batch_size = global_batch_size / dp, or {key} = 'sequence'",
    )
    require(
        job,
        not dims.pp_enabled,
        key,
        why + "pipeline parallelism splits it into "
        f"microbatches: use {key} = 'sequence' with pipeline parallelism",
    )
    require(
        job,
        not job.fault_tolerance.enable,
        key,
        why + "torchft's replica groups hold "
        f"parts of it outside the job's process group: use {key} = 'sequence' under torchft",
    )


def check_expert_parallel(job: JobConfig, moe, dims: ParallelDims) -> None:
    field = "parallelism.expert_parallel_degree"
    require(
        job,
        moe.n_experts % dims.ep == 0,
        field,
        f"the {moe.n_experts} routed experts do not split evenly over {dims.ep} ranks: "
        "pick a degree that divides them",
    )
    require(
        job,
        not job.fault_tolerance.enable,
        "fault_tolerance.enable",
        "torchft with expert parallelism is not supported: set expert_parallel_degree 1",
    )


def load_tokenizer(job: JobConfig) -> Tokenizer | None:
    """The configured tokenizer; None when it is missing and the job only plans (the planner
    then sizes the flavor's vocabulary, and vocabulary_note says so)."""
    m = job.model
    try:
        return Tokenizer(m.tokenizer_path)
    except TokenizerError as e:
        if not (job.plan_only and m.flavor != FROM_HF):
            raise ConfigError(str(e)) from None
        return None


FROM_HF = "from_hf"


def _hf_args(job: JobConfig, spec: TrainSpec, seq_len: int) -> ModelArgs | None:
    """The model args of the HF folder of checkpoint.initial_load_path, if it is one."""
    ck = job.checkpoint
    if not (ck.initial_load_in_hf and ck.initial_load_path):
        return None
    from titan.components.checkpoint.folders import CheckpointError
    from titan.components.checkpoint.hf_io import args_from_hf

    try:
        return args_from_hf(resolve(ck.initial_load_path), spec, max_seq_len=seq_len)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.initial_load_path = {ck.initial_load_path!r}: {e}") from None


def _differences(a: ModelArgs, b: ModelArgs, prefix: str = "") -> list[str]:
    """The differing fields, by dotted name down nested settings (an MoE's moe.n_experts)."""
    if is_dataclass(a) and is_dataclass(b) and type(a) is type(b):
        out = []
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if x != y:
                out += (
                    _differences(x, y, f"{prefix}{f.name}.")
                    if is_dataclass(x) and is_dataclass(y)
                    else [f"{prefix}{f.name} {x} vs {y}"]
                )
        return out
    return [] if a == b else [f"{prefix.rstrip('.') or 'args'} {a} vs {b}"]


def resolve_model_args(job: JobConfig, spec: TrainSpec, tokenizer: Tokenizer | None) -> ModelArgs:
    """The flavor's args (or an HF folder's, with model.flavor = "from_hf"), with the
    tokenizer's vocabulary (an HF model's embedding may be larger; no tokenizer: the
    flavor's own) and a RoPE table of exactly one sequence. An HF initial load must have the
    flavor's architecture."""
    m, seq_len = job.model, job.training.seq_len
    hf = _hf_args(job, spec, seq_len)
    if m.flavor == FROM_HF:
        require(
            job,
            hf is not None,
            "model.flavor",
            "'from_hf' takes the model's shape from "
            "an HF folder: set checkpoint.initial_load_path to it and "
            "checkpoint.initial_load_in_hf = true",
        )
        args = hf
    else:
        flavor = spec.flavors[m.flavor]
        args = flavor.with_updates(
            vocab_size=tokenizer.vocab_size if tokenizer else flavor.vocab_size, max_seq_len=seq_len
        )
        if hf is not None:
            diff = _differences(hf.with_updates(vocab_size=args.vocab_size), args)
            if diff:
                raise ConfigError(
                    f"checkpoint.initial_load_path {job.checkpoint.initial_load_path!r} holds "
                    f"another architecture than model.flavor = {m.flavor!r}: "
                    f'{"; ".join(diff)} (HF vs flavor). Set model.flavor = "{FROM_HF}" to '
                    "train the HF model's shape"
                )
            args = args.with_updates(vocab_size=hf.vocab_size)
    overrides = family_overrides(job, spec, args)
    args = args.with_updates(**overrides)
    problems = args.problems()
    if problems:
        # the settings a problem names (by its field, or an MoE's without the moe_ prefix),
        # with where each was set; not every one given
        given = "".join(
            f", {spec.name}.{k} = {v!r} (from {source_of(job, f'{spec.name}.{k}')})"
            for k, v in overrides.items()
            if any(k in p or k.removeprefix("moe_") in p for p in problems)
        )
        raise ConfigError(f"model {spec.name} {m.flavor}{given}: {'; '.join(problems)}")
    if tokenizer is not None and tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"the tokenizer {m.tokenizer_path!r} has {tokenizer.vocab_size} tokens "
            f"but the HF model's embedding only {args.vocab_size}: use the "
            "model's own tokenizer (model.tokenizer_path = the HF folder)"
        )
    return args


def family_overrides(job: JobConfig, spec: TrainSpec, args: ModelArgs) -> dict:
    """The family's options ([<family>]) set by a file or the command line that name a field
    of its ModelArgs: they override the flavor's value."""
    options = options_of(job, spec.name)
    if options is None:
        return {}
    return {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(options)
        if f"{spec.name}.{f.name}" in job.sources and hasattr(args, f.name)
    }


def vocabulary_note(job: JobConfig, run: RunPlan) -> str | None:
    """One line when the run's vocabulary is not its flavor's, which would otherwise go
    unseen: a tokenizer of another size (e.g. the bundled 2048 tokens with the 8B flavor)
    sizes the embedding and output layer; the planner without a tokenizer plans the flavor's."""
    m = job.model
    if m.flavor == FROM_HF or job.checkpoint.initial_load_in_hf:
        return None  # the HF model's own vocabulary
    flavor = run.spec.flavors[m.flavor].vocab_size
    if run.tokenizer is None:
        return (
            f"tokenizer {m.tokenizer_path!r} not found: planned with the {m.flavor} "
            f"flavor's {flavor}-token vocabulary (training needs the tokenizer)"
        )
    if run.tokenizer.vocab_size != flavor:
        return (
            f"the {m.flavor} flavor has a {flavor}-token vocabulary, the tokenizer "
            f"{m.tokenizer_path!r} {run.tokenizer.vocab_size}: the embedding and output "
            f"layer are sized for {run.tokenizer.vocab_size}"
        )
    return None


def device_type(job: JobConfig) -> str:
    """ "cuda" or "cpu", as the trainer will pick it."""
    import torch

    device = job.training.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "training.device = 'cuda' but no GPU is visible (torch.cuda."
            "is_available() is False); use 'auto' or 'cpu'"
        )
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def validation_batches(job: JobConfig, dp: int) -> tuple[int, int]:
    """(sequences per validation batch over all dp ranks, per forward on one rank)."""
    v = job.validation
    if v.global_batch_size == -1:
        local = 8 if v.local_batch_size == -1 else v.local_batch_size
        return local * dp, local
    require(
        job,
        v.global_batch_size % dp == 0,
        "validation.global_batch_size",
        f"must split evenly over the {dp} data-parallel ranks: pick a multiple of {dp}",
    )
    share = v.global_batch_size // dp
    local = share if v.local_batch_size == -1 else v.local_batch_size
    require(
        job,
        share % local == 0,
        "validation.local_batch_size",
        f"must divide each rank's share of a validation batch, global_batch_size / dp = "
        f"{v.global_batch_size} / {dp} = {share}",
    )
    return v.global_batch_size, local


def pipeline_plans(
    job: JobConfig, args: ModelArgs, validation_batch: int = 0
) -> tuple[PipelinePlan, ...]:
    """Every pipeline rank's stages for training batches, or (`validation_batch`: the
    sequences of a validation forward) for validation batches: same stages, as many
    microbatches as that forward holds. Stages balance the layers' costs where the family
    gives them (ModelArgs.layer_costs)."""
    validation = validation_batch > 0
    batch = validation_batch if validation else job.training.local_batch_size
    costs = args.layer_costs()
    try:
        return plan_pipelines(
            job.parallelism, n_layers=args.n_layers, local_batch_size=batch, layer_costs=costs
        )
    except PipelineConfigError as e:
        where = (
            f"validation.local_batch_size = {batch} (from "
            f"{source_of(job, 'validation.local_batch_size')})"
            if validation
            else "parallelism"
        )
        raise ConfigError(f"{where}: {e}") from None
