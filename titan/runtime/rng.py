"""The states of every random generator a step or an evaluation may draw from (torch's CPU
and CUDA ones, Python's, NumPy's), taken and given back: a replayed step draws what the step
drew, and an evaluation that seeds them leaves training's draws as they were."""

import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    python: tuple
    numpy: tuple

    @classmethod
    def take(cls, device: torch.device) -> "RngState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state())

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextmanager
def rng_kept(device: torch.device):
    """Whatever draws or seeding happens within, the generators leave as they came in."""
    state = RngState.take(device)
    try:
        yield
    finally:
        state.restore(device)
