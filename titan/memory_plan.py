"""Per-rank memory of a run, known before it starts: parameters, gradients and optimizer
states of every rank, from the model parts that rank would build (`titan.build.meta_parts`)
under a fake process group, so every sharding (FSDP's uneven last shards, TP's plans,
pipeline stages, tied copies) is torch's own and the bytes equal the run's.

Keys match `<dump_folder>/memory_measured.json`, which the trainer writes at its first step.
"""

import contextlib

import torch
import torch.distributed as dist

from titan.components.memory_measure import tensor_bytes
from titan.config import JobConfig
from titan.dtypes import to_dtype
from titan.preflight import RunPlan, plan_run


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A process group whose collectives do nothing: enough to build meshes and shard."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_state_bytes(job: JobConfig, world_size: int, rank: int) -> dict:
    """Parameters, gradients and optimizer states of one rank, in bytes."""
    from titan.build import meta_parts

    with fake_world(world_size, rank):
        plan: RunPlan = plan_run(job, world_size)
        plan.dims.build_mesh("cpu")
        _, parts, _ = meta_parts(job, plan)
        params = list({id(p): p for part in parts for p in part.parameters()}.values())
        trainable = [p for p in params if p.requires_grad]
        state_size = to_dtype(job.optimizer.state_dtype).itemsize
        # Adam: two moments per element in the state dtype, a float32 step count per tensor
        moments = sum(2 * tensor_bytes(p) // p.element_size() * state_size for p in trainable)
        return {"params_bytes": sum(tensor_bytes(p) for p in params),
                "grads_bytes": sum(tensor_bytes(p) for p in trainable),
                "optimizer_bytes": moments + 4 * len(trainable)}


def state_bytes_per_rank(job: JobConfig, world_size: int) -> list[dict]:
    return [rank_state_bytes(job, world_size, r) for r in range(world_size)]
