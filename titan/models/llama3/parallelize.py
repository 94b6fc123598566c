"""Apply the configured parallelisms to a Llama 3 model: TP -> AC -> compile -> FSDP/DDP."""

import torch
from torch import nn

from titan.parallelisms.activation_checkpoint import apply_ac
from titan.parallelisms.compile import compile_blocks, compile_whole
from titan.parallelisms.data_parallel import apply_ddp, apply_fsdp
from titan.parallelisms.parallel_dims import ParallelDims
from titan.parallelisms.tensor_parallel import parallelize_transformer


def parallelize_llama(model: nn.Module, dims: ParallelDims, job) -> nn.Module:
    par, training = job.parallelism, job.training
    if dims.tp_enabled:
        parallelize_transformer(model, dims["tp"], par.enable_sequence_parallel,
                                loss_parallel=not par.disable_loss_parallel)
    apply_ac(model.layers, job.activation_checkpoint.mode,
             job.activation_checkpoint.selective_ac_option)
    if job.compile.enable:
        # per-block compile + TP breaks in backward on CPU (torch 2.13): compile the whole model
        if dims.tp_enabled and not torch.cuda.is_available():
            compile_whole(model, job.compile.backend)
        else:
            compile_blocks(model.layers, job.compile.backend)
    # torchft averages gradients across replica groups in FSDP's all-reduce hook
    if dims.fsdp_enabled or job.fault_tolerance.enable:
        dp_mesh_dims = ("dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else ("dp_shard_cp",)
        apply_fsdp(model, dims[dp_mesh_dims], training.mixed_precision_param,
                   training.mixed_precision_reduce, par.fsdp_reshard_after_forward,
                   dims.pp_enabled, job.training.enable_cpu_offload)
    elif dims.dp_replicate > 1:
        apply_ddp(model, dims["dp_replicate"])
    return model
