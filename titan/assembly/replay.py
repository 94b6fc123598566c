"""A step run again from the same batch and the same random state (RunView.replay_step): what
tells bad data (the same figures again, to the bit where the kernels are deterministic) from a
faulty device (different figures, on the ranks whose own gradients changed).

The trainer keeps each step's microbatches (copies: context parallelism shards them in place)
and random state until the next step. A replay compares every rank's local gradient norm (the
squared norms of the gradient shards it holds, before clipping) between the two passes: a
device that computed wrongly once shows on its own rank. A fault before the gradients are
reduced (a wrong product in backward) reaches every rank that the reduction sums it into.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan.runtime.rng import RngState

# local gradient norms that differ by more than this (relative) differ: the first pass's are
# read from its clipped gradients and unscaled, exact to a few float roundings (~1e-7)
RANK_RTOL = 1e-4


def copies(microbatches: list[dict]) -> list[dict]:
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        for b in microbatches
    ]


@dataclass(frozen=True)
class StepInputs:
    microbatches: list[dict]
    rng: RngState

    @classmethod
    def keep(cls, microbatches: list[dict], device: torch.device) -> "StepInputs":
        return cls(copies(microbatches), RngState.take(device))


@dataclass(frozen=True)
class Replay:
    """The replayed step's global loss and gradient norm, and each rank's local gradient norm
    in the first pass and the replay (world_size x 2), the same on every rank."""

    loss: float
    grad_norm: float
    rank_norms: list[tuple[float, float]]

    def differing_ranks(self) -> list[int]:
        return [
            r
            for r, (a, b) in enumerate(self.rank_norms)
            if abs(a - b) > RANK_RTOL * max(abs(a), abs(b))
        ]


def local_grad_sq(params: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of the gradient shards this rank holds (float64)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += g.detach().double().pow(2).sum().cpu()
    return total


def unclipped(sq: torch.Tensor, grad_norm: float, max_norm: float) -> torch.Tensor:
    """A sum of squares of gradients clipped at max_norm (clip_grads_with_norm_'s factor),
    before the clip."""
    if max_norm <= 0:
        return sq
    factor = min(1.0, max_norm / (grad_norm + 1e-6))
    return sq / factor**2


def replay_step(trainer, edit=None) -> Replay:
    """The trainer's current step again from its kept inputs and random state, its
    microbatches first given to `edit` when given; the gradients left are the replay's."""
    if trainer.step_inputs is None:
        raise RuntimeError(
            "replay_step: no callback of this run says it replays steps (its `replays` "
            "attribute), so the step's inputs were not kept"
        )
    max_norm, figures = trainer.job.training.max_norm, trainer.figures
    first = unclipped(local_grad_sq(trainer.grad_params()[0]), figures.grad_norm, max_norm)
    trainer.step_inputs.rng.restore(trainer.device)
    microbatches = copies(trainer.step_inputs.microbatches)
    if edit is not None:
        microbatches = edit(microbatches)
    again = trainer.gradients(microbatches, figures.counted, replay=True)
    second = unclipped(local_grad_sq(trainer.grad_params()[0]), again.grad_norm, max_norm)
    return Replay(again.loss, again.grad_norm, gather_rank_norms(first, second, trainer.device))


def gather_rank_norms(first: torch.Tensor, second: torch.Tensor, device) -> list:
    pair = torch.stack([first, second]).sqrt().to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        table = [torch.empty_like(pair) for _ in range(dist.get_world_size())]
        dist.all_gather(table, pair)
    else:
        table = [pair]
    return [tuple(float(x) for x in t.tolist()) for t in table]
