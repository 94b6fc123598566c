"""Everything that can be checked before a process group, a folder or a file exists.

The launcher runs it once (so a bad run fails in a second with exit code 2 instead of
after torchrun starts N workers); each worker runs it again, as workers may be started
by other launchers.
"""

import os
from dataclasses import dataclass

from titan.components.tokenizer import Tokenizer, TokenizerError
from titan.config import ConfigError, JobConfig
from titan.config.manager import require
from titan.models.spec import TrainSpec, get_train_spec, registered_names
from titan.parallelisms.parallel_dims import ParallelDims, ParallelismError, validate_against_model

_UNAVAILABLE = {
    "pipeline_parallel_degree": "pipeline parallelism",
    "context_parallel_degree": "context parallelism",
}


@dataclass
class RunPlan:
    spec: TrainSpec
    model_args: object
    dims: ParallelDims
    tokenizer: Tokenizer
    global_batch_size: int
    grad_accum_steps: int


def plan_run(job: JobConfig, world_size: int | None = None) -> RunPlan:
    """Resolve model, tokenizer and parallel layout; raise ConfigError on any problem."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    m, t, par = job.model, job.training, job.parallelism
    try:
        spec = get_train_spec(m.name)
    except KeyError:
        raise ConfigError(
            f"model.name = {m.name!r} is not a registered model; choose one of "
            f"{', '.join(registered_names())}"
        ) from None
    require(job, m.flavor in spec.flavors, "model.flavor",
            f"{m.name} has flavors {', '.join(spec.flavors)}")
    try:
        tokenizer = Tokenizer(m.tokenizer_path)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    # the tokenizer decides the vocabulary; the RoPE table covers exactly one sequence
    model_args = spec.flavors[m.flavor].with_updates(vocab_size=tokenizer.vocab_size,
                                                     max_seq_len=t.seq_len)
    for key, what in _UNAVAILABLE.items():
        require(job, getattr(par, key) == 1, f"parallelism.{key}",
                f"{what} is not supported by this version of titan; set it to 1")
    try:
        dims = ParallelDims(
            dp_replicate=par.data_parallel_replicate_degree,
            dp_shard=par.data_parallel_shard_degree, cp=par.context_parallel_degree,
            tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
            world_size=world_size,
        )
        global_batch = (t.global_batch_size if t.global_batch_size != -1
                        else t.local_batch_size * dims.dp)
        validate_against_model(dims, model_args.n_heads, model_args.kv_heads, model_args.n_layers,
                               t.seq_len, t.local_batch_size, global_batch)
    except ParallelismError as e:
        raise ConfigError(f"parallelism: {e}") from None
    if job.training.enable_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError("training.enable_cpu_offload needs FSDP (data_parallel_shard_degree > 1)")
    return RunPlan(spec, model_args, dims, tokenizer, global_batch,
                   global_batch // (t.local_batch_size * dims.dp))
