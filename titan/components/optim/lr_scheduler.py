"""Warmup, optional stable phase (WSD), then linear/sqrt/cosine decay to a min-lr factor."""

import logging
import math
from functools import partial

import torch

from titan.runtime.console import plural

logger = logging.getLogger(__name__)


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr used by optimizer step `step` (1-based)."""
    warmup = min(warmup_steps, total_steps)
    if step <= warmup:
        return step / max(warmup, 1) if warmup else 1.0
    decay_steps = total_steps - warmup if decay_ratio is None else round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps <= 0:
        return 1.0  # stable phase of warmup-stable-decay
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay_type {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


class LRSchedulersContainer:
    """Sets every param group's lr from the step count; a Stateful for DCP.

    The schedule is a pure function of the step, so its checkpoint state is one integer.
    """

    def __init__(
        self,
        optimizer,
        total_steps: int,
        warmup_steps: int,
        decay_ratio: float | None,
        decay_type: str,
        min_lr_factor: float,
        scale=None,
    ):
        self.optimizer = optimizer
        self.scale = scale
        self.factor = partial(
            lr_factor,
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            decay_ratio=decay_ratio,
            decay_type=decay_type,
            min_lr_factor=min_lr_factor,
        )
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.steps_done = 0
        self._apply()

    def _apply(self) -> None:
        # the lr of step s (1-based) is set after s - 1 steps are done
        step = self.steps_done + 1
        f = self.factor(step) * (self.scale(step) if self.scale else 1.0)
        self.last_factor = f
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * f

    def step(self) -> None:
        self.steps_done += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"steps_done": torch.tensor(self.steps_done, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        self.steps_done = int(state["steps_done"])
        self._apply()


def build_lr_scheduler(optimizer, cfg, total_steps: int, scale=None) -> LRSchedulersContainer:
    """The schedule of `cfg` (the lr_scheduler section) over `total_steps` optimizer steps,
    times `scale(step)` where given (the lr of a scheduled batch size)."""
    if cfg.warmup_steps > total_steps:
        logger.warning(
            "lr_scheduler.warmup_steps %d exceeds training.steps %d: the warmup is "
            "cut to %s, the lr reaching optimizer.lr at the last step; set "
            "lr_scheduler.warmup_steps <= training.steps to keep this schedule in "
            "a longer run",
            cfg.warmup_steps,
            total_steps,
            plural(total_steps, "step"),
        )
    return LRSchedulersContainer(
        optimizer,
        total_steps,
        cfg.warmup_steps,
        cfg.decay_ratio,
        cfg.decay_type,
        cfg.min_lr_factor,
        scale=scale,
    )
