"""A checkpoint's model on a training layout, for titan.tools.eval under pipeline or context
parallelism, or data and tensor parallelism together: the parts the trainer would build for
that layout (titan.assembly.build), their weights read as a training run's initial load reads
them (each rank its shards, from a DCP step or an HF folder), and the trainer's forward
(ForwardBackward: token_scores on any layout, logits with the decode cache where the layout
runs one model part over whole sequences)."""

import dataclasses
import tempfile
from pathlib import Path


def layout_forward(job, path: Path, spec, max_length: int):
    """(ForwardBackward over this rank's parts of `job`'s layout holding `path`'s weights, the
    data-parallel process group or None). Starts the process group. Raises ConfigError,
    CheckpointError, GenerateError."""
    from titan.assembly.build import meta_parts, run_identity
    from titan.assembly.microbatch import ForwardBackward
    from titan.components.checkpoint.checkpointer import Checkpointer
    from titan.components.checkpoint.folders import saved_model
    from titan.components.checkpoint.hf_io import HFModelIO
    from titan.components.converters import Converters
    from titan.components.lora.merged import adapters_of
    from titan.plan.run_plan import FROM_HF, plan_run
    from titan.runtime.distributed import init_distributed, pick_device
    from titan.tools import generate as gen

    hf = gen._is_hf(path)
    if not hf and adapters_of(saved_model(path)):
        raise gen.GenerateError(
            f"{path} holds LoRA adapters only: evaluate it in one process or with "
            "--parallelism.tensor_parallel_degree (the adapters are folded into the base there)"
        )
    ck = job.checkpoint
    ck.enable, ck.initial_load_model_only = False, True
    ck.initial_load_path, ck.initial_load_in_hf = str(path), hf
    # the RoPE table the requests need (and, under context parallelism, the padded width)
    job.training.seq_len = max_length
    job.model.flavor = FROM_HF if hf else (saved_model(path) or {}).get("flavor", job.model.flavor)
    job.activation_checkpoint.mode, job.compile.enable = "none", False
    if "training.mixed_precision_param" not in job.sources:
        # as one process evaluates: in the checkpoint's float32, unless bf16 is asked for
        job.training.mixed_precision_param = "float32"
    plan = plan_run(job)
    if not hf:  # the architecture the checkpoint records (its family options included)
        args = gen.model_args(path, job, spec).with_updates(max_seq_len=max_length)
        plan = dataclasses.replace(plan, model_args=args)
    device = pick_device(job.training.device)
    rank, _ = init_distributed(device, job.comm.init_timeout_seconds)
    plan.dims.build_mesh(device.type)
    converters = Converters(job)
    _, parts, pp_plan = meta_parts(job, plan, converters)
    for part in parts:
        part.to_empty(device=device)
        part.init_weights(job.training.seed, buffer_device=device)  # the RoPE table
        converters.init_weights(part, job.training.seed)
        part.eval()
    Checkpointer(
        ck,
        dump_folder=tempfile.gettempdir(),  # nothing is saved
        states={"model": converters.model_state(parts)},
        rank=rank,
        identity=run_identity(job, plan, converters),
        hf=HFModelIO(plan.spec, plan.model_args, plan.tokenizer) if hf else None,
    ).load()
    dp = plan.dims["dp"]
    group = dp.get_group() if dp.size() > 1 else None
    return ForwardBackward(job, plan, parts, pp_plan, device), group
