"""FSDP2 / HSDP / DDP over the data-parallel dims of the mesh."""

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

# under TP the embedding's output is a view of its redistributed tensor, which FSDP warns
# about on every start for the in-place use that would skip its hook; the decoders use it out
# of place (h = h + block(h)), so the warning only says what titan never does
warnings.filterwarnings(
    "ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor"
)


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """`parallelism.fsdp_reshard_after_forward` as a bool: under pipelining each microbatch
    would re-gather freed params, so "default" keeps them there."""
    return {"always": True, "never": False, "default": not pp_enabled}[policy]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    units: list[nn.Module],
    final_unit: list[nn.Module],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard: bool,
    cpu_offload: bool,
    expert_units: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard each of `units` (embedding, blocks) as its own FSDP unit, `final_unit` (e.g. the
    last norm and the output layer) as one unit, then the root for what is left. Each of
    `expert_units` (expert-parallel routed experts, inside the blocks) is a unit of its own
    over `expert_mesh`: the data-parallel ranks that hold the same experts.

    A 2-D dp_mesh (dp_replicate, dp_shard_cp) gives HSDP.
    """
    kw = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    )
    if cpu_offload:
        # pinned memory needs CUDA; on CPU-only machines plain host memory is the only option
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")
    for unit in expert_units:
        fully_shard(unit, reshard_after_forward=reshard, **{**kw, "mesh": expert_mesh})
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard, **kw)
    if final_unit:
        # the last unit is needed again at once by backward: never reshard it
        fully_shard(final_unit, reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
