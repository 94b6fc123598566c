"""The training loss and how per-rank losses become the one logged number.

Each rank's loss is a sum of token cross-entropies divided by a token count fixed in advance
(every token of the rank's step), so gradient accumulation, pipeline microbatches and
sequence shards all add up to the mean over the global batch.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# a label the loss does not count (a prompt's token, padding): cross_entropy's default
IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy of (batch, seq, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's log-probability of its target, the most likely token) of (batch, seq,
    vocab) logits, in float32; vocabulary-parallel logits are gathered whole first."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logits = logits.float()
    logprobs = F.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return logprobs, logits.argmax(-1)


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed log(Z)^2 of the tokens the loss counts, Z the softmax normalizer of each
    token's (batch, seq, vocab) logits, in float32. Vocabulary-parallel logits (a DTensor
    sharded over the vocabulary, as loss parallelism leaves them) are reduced shard by shard:
    each rank's maximum and sum of exponentials, all-reduced, never the whole logits."""
    logits = logits.float()
    counted = labels != IGNORE_INDEX
    if isinstance(logits, DTensor):
        from torch.distributed.tensor import Replicate

        counted = DTensor.from_local(
            counted, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim
        )
    peak = logits.detach().amax(dim=-1, keepdim=True)
    log_z = peak.squeeze(-1) + (logits - peak).exp().sum(dim=-1).log()
    return (log_z.square() * counted).sum()


def plain(t: torch.Tensor) -> torch.Tensor:
    """Loss parallel leaves replicated DTensors; the step's bookkeeping uses plain tensors."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def reduce_loss(
    loss: torch.Tensor, *, pp_group: dist.ProcessGroup | None, dp_cp_group: dist.ProcessGroup | None
) -> None:
    """In place: sum over pipeline stages (only the last one holds the loss), then the mean
    over data-parallel and context-parallel ranks."""
    if pp_group is not None:
        dist.all_reduce(loss, group=pp_group)
    if dp_cp_group is not None:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_cp_group)


def sum_over(t: torch.Tensor, groups: list[dist.ProcessGroup | None]) -> None:
    """In place: the sum over each of `groups` in turn (None: nothing to sum)."""
    for g in groups:
        if g is not None:
            dist.all_reduce(t, group=g)
