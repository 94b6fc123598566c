"""The core sections' entries ([job], [model], [training], [parallelism], [comm], [memory]):
their checks of the config alone, what they make ignored, and the plan checks that need the
planned run (titan.plan.checks; the memory plan's in titan.planner.memory). Registered first,
so a core problem is named before a component's."""

from titan.config.entry import Entry, changed_keys, register


def check_core(cfg) -> None:
    from titan.config.manager import require_all

    t, c = cfg.training, cfg.comm
    require_all(
        cfg,
        [
            (cfg.job.dump_sync_interval_s > 0, "job.dump_sync_interval_s", "must be > 0 seconds"),
            (t.steps >= 1, "training.steps", "must be >= 1"),
            (t.seq_len >= 1, "training.seq_len", "must be >= 1"),
            (t.local_batch_size >= 1, "training.local_batch_size", "must be >= 1"),
            (
                t.global_batch_size == -1 or t.global_batch_size >= 1,
                "training.global_batch_size",
                "must be -1 (local x dp) or >= 1",
            ),
            (t.max_norm >= 0, "training.max_norm", "must be >= 0 (0 disables clipping)"),
            (t.gc_freq >= 1, "training.gc_freq", "must be >= 1"),
            (t.dataloader_num_workers >= 0, "training.dataloader_num_workers", "must be >= 0"),
            (
                t.dataloader_prefetch_factor >= 1,
                "training.dataloader_prefetch_factor",
                "must be >= 1",
            ),
            (
                not cfg.model.document_positions or cfg.model.attn_mask_type == "block_causal",
                "model.document_positions",
                'needs model.attn_mask_type = "block_causal" (with a '
                "causal mask across documents, positions run through the window)",
            ),
            (c.init_timeout_seconds >= 1, "comm.init_timeout_seconds", "must be >= 1"),
            (c.train_timeout_seconds >= 1, "comm.train_timeout_seconds", "must be >= 1"),
            (
                c.trace_buf_size >= 0,
                "comm.trace_buf_size",
                "the flight recorder keeps that many collectives: 0 (off) or more",
            ),
            (
                cfg.memory.device_memory_gib >= 0,
                "memory.device_memory_gib",
                "must be > 0 (a device's memory in GiB), or 0 for the visible GPU's own",
            ),
            (
                t.exit_at_step == -1 or t.exit_at_step >= 1,
                "training.exit_at_step",
                "must be -1 (never) or >= 1",
            ),
        ],
    )


def check_schedules(job) -> None:
    """What the batch and length schedules cannot run with, from the config alone."""
    from titan.config.manager import require

    t = job.training
    require(
        job,
        t.batch_lr_scaling == "none" or bool(t.global_batch_schedule),
        "training.batch_lr_scaling",
        "scales the lr of scheduled batch sizes, and training.global_batch_schedule is empty: "
        "set the schedule, or leave batch_lr_scaling = 'none'",
    )
    for key, on, what in (
        ("training.global_batch_schedule", bool(t.global_batch_schedule), "size"),
        ("training.seq_len_schedule", bool(t.seq_len_schedule), "shape"),
    ):
        require(
            job,
            not (on and job.fault_tolerance.enable),
            key,
            f"is not yet supported with fault_tolerance.enable (a heal seeks steps of one {what})",
        )
    require(
        job,
        not (t.global_batch_schedule and t.dataset_streaming),
        "training.global_batch_schedule",
        "needs a local dataset without training.dataset_streaming (a streamed one cannot "
        "regroup its batches)",
    )
    require(
        job,
        not t.seq_len_schedule or (t.dataset_format == "text" and not t.dataset_streaming),
        "training.seq_len_schedule",
        "needs packed text read indexed (training.dataset_format = 'text' without "
        "dataset_streaming): a shorter window is a piece of a training.seq_len window",
    )


def ignored_parallelism(job) -> dict[str, str]:
    """The [parallelism] options of a parallelism the run does not use."""
    p, out = job.parallelism, {}
    unused = {
        "context_parallel_": p.context_parallel_degree == 1,
        "pipeline_parallel_": p.pipeline_parallel_degree == 1,
    }
    # typed on the command line: a config file's are a template for the other degrees
    typed = changed_keys(job, "parallelism", typed=True)
    for key in typed:
        name = key.split(".", 1)[1]
        for prefix, off in unused.items():
            if off and name.startswith(prefix) and name != prefix + "degree":
                out[key] = f"parallelism.{prefix}degree is 1"
        if p.tensor_parallel_degree == 1 and name in (
            "enable_sequence_parallel",
            "disable_loss_parallel",
        ):
            out[key] = "parallelism.tensor_parallel_degree is 1"
    if p.context_parallel_degree > 1 and p.context_parallel_type != "hybrid":
        key = "parallelism.context_parallel_alltoall_degree"
        if key in typed:
            out[key] = f"parallelism.context_parallel_type is {p.context_parallel_type}"
    return out


register(Entry("training", check=check_core))
register(Entry("schedules", check=check_schedules))
register(Entry("parallelism", ignored=ignored_parallelism))
# of a run about to start: its checkpoint folders and the memory its plan needs (their
# modules sit above this layer, named by path)
_FOLDERS = "titan.assembly.checkpoint_check:check_checkpoints"
register(Entry("checkpoint folders", plan_check=_FOLDERS, reads_inputs=True))
register(Entry("memory", plan_check="titan.planner.memory:plan_check", reads_inputs=True))
