"""FSDP2 / HSDP / DDP over the data-parallel dims of the mesh."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: str, reduce_dtype: str,
               reshard_after_forward: str, pp_enabled: bool, cpu_offload: bool) -> None:
    """Shard each block, the embedding and the head+norm as separate units, then the root.

    A 2-D dp_mesh (dp_replicate, dp_shard_cp) gives HSDP.
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    kw = dict(mesh=dp_mesh, mp_policy=mp)
    if cpu_offload:
        # pinned memory needs CUDA; on CPU-only machines plain host memory is the only option
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # under pipelining each microbatch would re-gather freed params: keep them by default
    reshard = {"always": True, "never": False, "default": not pp_enabled}[reshard_after_forward]
    if getattr(model, "tok_embeddings", None) is not None:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kw)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kw)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if head:
        # the last unit is needed again at once by backward: never reshard it
        fully_shard(head, reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
