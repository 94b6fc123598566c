"""Per-replica-group fault tolerance with torchft (optional `[torchft]` extra).

Each replica group is its own torchrun job (FSDP/TP/CP inside it); torchft stands in for the
dp_replicate dimension: gradients are averaged across the live groups through torchft's
ManagedProcessGroup in FSDP's all-reduce hook, every step asks the lighthouse for a quorum,
the optimizer steps only when the whole quorum committed, and a group that (re)joins heals
from a live peer's state. A dead group costs the others one step, not a restart.

Two torchft 0.2 behaviours shape this: its DistributedDataParallel crashes the surviving group
when a peer dies mid-step (so the FSDP hook is used instead), and FSDP2's state_dict() must
not run on torchft's thread during a step (so the model state dict is cached once).
"""

import datetime
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)


class FaultTolerance:
    """Configured by `cfg` (the fault_tolerance section)."""

    def __init__(self, cfg, *, device: torch.device):
        import torchft
        from torchft.process_group import ManagedProcessGroup

        timeout = datetime.timedelta(seconds=cfg.timeout_seconds)
        pg = (
            torchft.ProcessGroupNCCL(timeout=timeout)
            if device.type == "cuda"
            else torchft.ProcessGroupGloo(timeout=timeout)
        )
        self.manager = torchft.Manager(
            pg=pg,
            min_replica_size=cfg.min_replica_size,
            load_state_dict=None,
            state_dict=None,
            use_async_quorum=True,
            replica_id=f"titan_{cfg.replica_id}",
            timeout=timeout,
            quorum_timeout=timeout * 3,
            connect_timeout=timeout,
            # every group starts from the same seeded weights: nothing to sync at step 0
            init_sync=False,
        )
        self.replicate_pg = ManagedProcessGroup(self.manager)
        self.replicate_pg.register("dp_replicate")

    def average_gradients_across_groups(self, parts: list[nn.Module]) -> None:
        def hook(grad: torch.Tensor) -> None:
            dist.all_reduce(grad, group=self.replicate_pg, op=dist.ReduceOp.AVG)

        for part in parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_all_reduce_hook(hook)

    def register_state(self, states: dict, on_heal) -> None:
        """`states`: name -> Stateful; the model's dict is cached once (see module doc)."""
        cached_model = states["model"].state_dict()

        def state_fn() -> dict:
            return {
                k: (cached_model if k == "model" else v.state_dict()) for k, v in states.items()
            }

        def load_fn(sd: dict) -> None:
            for k, v in states.items():
                v.load_state_dict(sd[k])
            on_heal()

        self.manager.register_state_dict_fn("titan", load_fn, state_fn)

    def start_step(self) -> None:
        self.manager.start_quorum()

    def should_commit(self) -> bool:
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
