"""What a run holds per rank, measured on its real tensors at the first step, in the keys of
the memory planner (titan.memory_plan): `<dump_folder>/memory_measured.json`."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_bytes(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer states (local shards; a
    parameter tied to another counts once)."""
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    opt_bytes = sum(tensor_bytes(v) for opt in optimizers for state in opt.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor))
    return {"params_bytes": sum(tensor_bytes(p) for p in params),
            "grads_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": opt_bytes}


def write_measured(path: Path, mine: dict, rank: int) -> dict:
    """Gather every rank's figures; rank 0 writes {"ranks": [...]}. Collective."""
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    record = {"ranks": ranks}
    if rank == 0:
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record
