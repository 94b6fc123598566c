"""A layout's split of the step's tokens as a model's group losses (titan.models.common.
aux_loss) see it (`TokenSplit`), and the one a layout gives (`token_split`): which ranks hold
the rest of a sequence and of the global batch within one forward, and how many ranks average
or replicate a rank's gradient.

Within one pipeline stage, a sequence is split over the context-parallel ranks and, with
sequence parallelism, the tensor-parallel ranks; the global batch over those and the
data-parallel ones (expert parallelism borrows its ranks from them and splits no sequence).
Tensor-parallel ranks without sequence parallelism each hold every token of their batch.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from titan.parallelisms.parallel_dims import ParallelDims


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class TokenSplit:
    """How a layout splits the step's tokens, as a group loss needs to know it. The defaults
    are one process: nothing split, nothing averaged. Built for a run by
    titan.parallelisms.token_split."""

    sequences: int = 0  # sequences in the step (the global batch); 0: this forward's
    seq_len: int = 0  # tokens in each; 0: this forward's
    # sums (no gradient) of a tensor over the ranks holding the other tokens of this rank's
    # sequences in this forward (context parallelism, sequence-parallel TP)...
    sum_over_sequence: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)
    # ... and over the ranks holding the rest of the global batch in this forward (those and
    # the data-parallel ranks); only valid when each rank's step is one forward
    sum_over_batch: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)
    # ranks whose gradients are averaged (data parallel x context parallel), so a rank's
    # share counts this many times over
    grad_scale: int = 1
    # ranks that compute the same share (tensor-parallel ranks without sequence parallelism)
    replicas: int = 1
    # ranks of a pipeline stage: a mean over microbatches is logged as their average
    stage_ranks: int = 1


def _summed_over(meshes: list[DeviceMesh]):
    meshes = [m for m in meshes if m.size() > 1]
    if not meshes:
        return lambda t: t

    def total(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        for mesh in meshes:
            t = funcol.wait_tensor(funcol.all_reduce(t, "sum", mesh))
        return t

    return total


def token_split(
    dims: ParallelDims,
    *,
    sequence_parallel: bool,
    global_batch_size: int,
    seq_len: int,
    data_parallel_size: int,
) -> TokenSplit:
    """For a run whose mesh is built; `data_parallel_size` counts torchft's replica groups."""
    tp_splits = dims.tp_enabled and sequence_parallel
    in_sequence = [dims["cp"]] + ([dims["tp"]] if tp_splits else [])
    return TokenSplit(
        sequences=global_batch_size,
        seq_len=seq_len,
        sum_over_sequence=_summed_over(in_sequence),
        sum_over_batch=_summed_over([dims["dp_cp"]] + ([dims["tp"]] if tp_splits else [])),
        grad_scale=data_parallel_size * dims.cp,
        replicas=dims.tp if dims.tp_enabled and not sequence_parallel else 1,
        stage_ranks=dims.world_size // dims.pp,
    )
