"""The planned run's core checks, as entries: the layout against the model and the batch,
what an MoE model cannot combine with, each step's shape under a length schedule. They run
in titan.config.entry.check_plan with the components' own, before any rank starts.
Torch-free when imported (the config's entries are read before torch loads)."""

from titan.config.entry import Entry, register


def check_layout(job, plan) -> None:
    """The parallel degrees against the model, the batch and the device."""
    from titan.config import ConfigError
    from titan.config.manager import require
    from titan.parallelisms.parallel_dims import (
        ParallelismError,
        heads_group_size,
        validate_against_model,
    )

    dims, args, t, m = plan.dims, plan.model_args, job.training, job.model
    try:
        validate_against_model(
            dims,
            args,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=plan.global_batch_size,
            dp_size=plan.data_parallel_size,
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
        heads = {"heads": args.n_heads, "kv heads": getattr(args, "n_kv_heads", None)}
        for name, n in heads.items():
            require(
                job,
                not n or n % (dims.tp * a) == 0,
                "parallelism.context_parallel_type",
                f"{cp_type!r} splits each TP rank's {name} over {a} ranks: model {m.name} "
                f"{m.flavor} has {n} {name}, which tp {dims.tp} x {a} does not divide; "
                "use 'ring', or a cp (and tp) that divides them",
            )
    problems = args.layout_problems(dims)  # the family's own
    if problems:
        raise ConfigError(f"parallelism: model {m.name} {m.flavor}: {'; '.join(problems)}")
    if dims.cp_enabled:
        from titan.parallelisms.context_parallel import check_torch_version

        try:
            check_torch_version(plan.device)
        except RuntimeError as e:
            raise ConfigError(f"parallelism.context_parallel_degree = {dims.cp}: {e}") from None
    require(
        job,
        not dims.pp_enabled or plan.spec.pipelining_fn is not None,
        "parallelism.pipeline_parallel_degree",
        f"model {m.name} registers no pipeline split function",
    )
    require(
        job,
        not t.enable_cpu_offload or dims.fsdp_enabled,
        "training.enable_cpu_offload",
        "needs FSDP (data_parallel_shard_degree > 1)",
    )


def check_moe(job, plan) -> None:
    """What an MoE model cannot combine with, at every global batch the run trains."""
    from titan.config.manager import require

    spec, args, dims = plan.spec, plan.model_args, plan.dims
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
        require(
            job,
            moe.n_experts % dims.ep == 0,
            "parallelism.expert_parallel_degree",
            f"the {moe.n_experts} routed experts do not split evenly over {dims.ep} ranks: "
            "pick a degree that divides them",
        )
        require(
            job,
            not job.fault_tolerance.enable,
            "fault_tolerance.enable",
            "torchft with expert parallelism is not supported: set expert_parallel_degree 1",
        )
    adapter = spec.state_dict_adapter
    if job.checkpoint.last_save_in_hf and adapter is not None:
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
        per_step = job.training.local_batch_size * plan.data_parallel_size
        sizes = plan.batch_schedule.sizes() if plan.batch_schedule else ()
        for size in (plan.global_batch_size, *sizes):
            _check_global_batch_scope(job, spec.name, dims, size // per_step)
    rate = moe.bias_update_rate
    require(
        job,
        not (rate and job.fault_tolerance.enable),
        "fault_tolerance.enable",
        f"the routing-bias update ({spec.name}.moe_bias_update_rate = {rate}) sums expert "
        "loads over this replica group only, so groups would route differently: set the "
        "rate to 0 under torchft",
    )


def _check_global_batch_scope(job, family: str, dims, grad_accum: int) -> None:
    """A balancing loss over the whole global batch needs every expert's count of the batch
    before any backward: each rank's step must be one forward."""
    from titan.config.manager import require

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


def check_seq_len_schedule(job, plan) -> None:
    """Each step's shape under training.seq_len_schedule fits the layout and the data."""
    from titan.config import ConfigError
    from titan.config.manager import require
    from titan.parallelisms.parallel_dims import ParallelismError, validate_against_model
    from titan.plan.seq_len_schedule import change_steps

    lengths, batches = plan.seq_len_schedule, plan.batch_schedule
    if lengths is None:
        return
    t, key, dp = job.training, "training.seq_len_schedule", plan.data_parallel_size
    for step in change_steps(lengths, batches):
        size = batches.size_at(step) if batches else plan.global_batch_size
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
                plan.dims,
                plan.model_args,
                seq_len=length,
                local_batch_size=local,
                global_batch_size=local * dp,
                dp_size=dp,
                cp_load_balance=job.parallelism.context_parallel_load_balance,
            )
        except ParallelismError as e:
            raise ConfigError(f"{key}: step {step} at {length} tokens: {e}") from None


register(Entry("layout", plan_check=check_layout))
register(Entry("moe", plan_check=check_moe))
register(Entry("seq_len_schedule", plan_check=check_seq_len_schedule))
