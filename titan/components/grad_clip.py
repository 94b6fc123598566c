"""Global gradient-norm clipping over plain and DTensor (sharded/replicated) gradients."""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    extra_group: dist.ProcessGroup | None = None,
                    uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Clip to `max_norm` (0 = measure only) and return the total 2-norm as a plain tensor.

    DTensor norms are reduced over their own mesh; `extra_group` sums squared norms over
    ranks that hold disjoint parameters (pipeline stages). `uncounted` are clipped but not
    counted: copies of a parameter counted elsewhere (a tied weight's pipeline copy).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if extra_group is not None:
        sq = total.pow(2)
        dist.all_reduce(sq, group=extra_group)
        total = sq.sqrt()
    if max_norm > 0:
        params += [p for p in uncounted if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
