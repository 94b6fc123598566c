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
)
from titan.parallelisms.pipeline import PipelineConfigError, PipelinePlan, plan_pipelines
from titan.plan.batch_schedule import BatchSchedule, parse_schedule
from titan.plan.seq_len_schedule import (
    SeqLenSchedule,
    StepShape,
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
    job: JobConfig,
    world_size: int | None = None,
    tokenizer: Tokenizer | None = None,
    starting: bool = False,
) -> RunPlan:
    """Resolve model, tokenizer and parallel layout, then run every entry's plan check
    (titan.config.entry.check_plan); raise ConfigError on any problem.

    Once per process and job: every part of a run reads the plan, not the config again.
    `tokenizer`: the job's, when the caller has read it already (the same job at another
    world size or layout); read here otherwise. `starting`: the plan of a run about to start
    (the launcher's, a worker's), whose checks read its data, checkpoints and memory too;
    otherwise a plan only weighed (the planner's, a tool's, the layout search's)."""
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
    except ParallelismError as e:
        raise ConfigError(f"parallelism: {e}") from None
    ft = job.fault_tolerance
    dp_size = dims.dp * (ft.group_size if ft.enable else 1)
    global_batch = (
        t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp_size
    )
    val_global, val_local = validation_batches(job, dp_size) if job.validation.enable else (0, 0)
    schedule = lengths = None
    if t.global_batch_schedule:
        schedule = parse_schedule(job, global_batch, t.local_batch_size * dp_size)
    if t.seq_len_schedule:
        lengths = parse_seq_len_schedule(job)
    plan = RunPlan(
        spec,
        model_args,
        dims,
        tokenizer,
        global_batch,
        global_batch // (t.local_batch_size * dp_size),
        dp_size,
        device,
        validation_global_batch=val_global,
        validation_local_batch=val_local,
        batch_schedule=schedule,
        seq_len=t.seq_len,
        seq_len_schedule=lengths,
    )
    extensions.check_plan(job, plan)
    # split once the layout's checks passed; the memory plan (a check of the inputs) reads it
    if dims.pp_enabled:
        plan.pipelines = pipeline_plans(job, model_args)
        if job.validation.enable:
            plan.validation_pipelines = pipeline_plans(job, model_args, validation_batch=val_local)
    if starting:
        extensions.check_inputs(job, plan)
    return plan


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
    """(sequences per validation batch over all dp ranks, per forward on one rank); whether
    they split evenly is validation's plan check."""
    v = job.validation
    if v.global_batch_size == -1:
        local = 8 if v.local_batch_size == -1 else v.local_batch_size
        return local * dp, local
    share = v.global_batch_size // dp
    return v.global_batch_size, share if v.local_batch_size == -1 else v.local_batch_size


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
