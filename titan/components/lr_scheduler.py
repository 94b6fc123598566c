"""Warmup, optional stable phase (WSD), then linear/sqrt/cosine decay to a min-lr factor."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_ratio: float | None,
              decay_type: str, min_lr_factor: float) -> float:
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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                       decay_ratio: float | None, decay_type: str,
                       min_lr_factor: float) -> LambdaLR:
    # LambdaLR evaluates its lambda at 0 on construction; the lr of step s is lambda(s - 1)
    return LambdaLR(optimizer, lambda i: lr_factor(i + 1, total_steps, warmup_steps, decay_ratio,
                                                   decay_type, min_lr_factor))
