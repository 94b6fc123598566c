"""The [lr_scheduler] section (warmup, then a constant phase and a decay) and its checks;
torch-free (the schedule is lr_scheduler.py)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Linear warmup steps from ~0 to the peak lr")
    decay_ratio: float | None = opt(
        None, "Fraction of steps spent decaying at the end; None = all after warmup (<1 gives WSD)"
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "Shape of the decay phase")
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of the peak lr")


def check(job) -> None:
    from titan.config.manager import require_all

    s = job.lr_scheduler
    require_all(
        job,
        (
            (s.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0"),
            (
                s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
                "lr_scheduler.decay_ratio",
                "must be None or in [0, 1]",
            ),
            (0 <= s.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", "must be in [0, 1]"),
        ),
    )


register(Entry("lr_scheduler", section="lr_scheduler", options=LRScheduler, check=check))
