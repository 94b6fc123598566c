"""The [stability] section: loss and gradient-norm spikes scored against a rolling window of
the steps before, logged, skipped or stopped at; torch-free (the callback is stability.py)."""

from dataclasses import dataclass
from typing import Literal

from titan.components.training.callbacks import CallbackSpec
from titan.config import extensions
from titan.config.entry import register
from titan.config.job_config import opt

METRICS = ("loss", "grad_norm")


@dataclass
class Stability:
    spike_window: int = opt(
        0,
        "Steps a step's loss and grad norm are scored against (their mean and standard "
        "deviation), from the step after it is full. 0: off (OLMo-core: 128)",
    )
    spike_sigma: float = opt(
        6.0, "A step is a spike when a figure exceeds the window's mean by this many std"
    )
    spike_metrics: list[str] = opt(list(METRICS), "The figures scored: loss, grad_norm")
    rerun_on_spike: bool = opt(
        False,
        "Replay a flagged step once (same batch, same random state) before acting: the same "
        "loss and grad norm blame the data, different ones the devices (the ranks whose own "
        "gradients changed are named)",
    )
    rerun_rtol: float = opt(
        0.0,
        "Replayed figures within this relative difference count as the same: 0 = bitwise "
        "(CPU, and GPU with training.deterministic); a GPU's non-deterministic kernels need more",
    )
    on_spike: Literal["log", "skip", "stop"] = opt(
        "log",
        "At a spike: log it (the update is taken); skip its optimizer step (parameters and "
        "optimizer state untouched; the lr schedule and the data move on); or stop the run",
    )


def check(job) -> None:
    from titan.config.manager import require_all

    s = job.stability
    require_all(
        job,
        (
            (
                s.spike_window == 0 or s.spike_window >= 2,
                "stability.spike_window",
                "needs at least 2 steps for a standard deviation (0: off)",
            ),
            (s.spike_sigma > 0, "stability.spike_sigma", "must be > 0"),
            (s.rerun_rtol >= 0, "stability.rerun_rtol", "must be >= 0 (0: bitwise)"),
            (
                bool(s.spike_metrics) and set(s.spike_metrics) <= set(METRICS),
                "stability.spike_metrics",
                f"must name one or both of {', '.join(METRICS)}",
            ),
        ),
    )


def _ignored(job) -> dict:
    off = job.stability.spike_window == 0
    why = "stability.spike_window is 0: spike detection is off"
    return extensions.ignored_when(job, "stability", off, why, switch="spike_window")


register(
    CallbackSpec(
        "stability",
        build="titan.components.training.stability:build_callback",
        check=check,
        section="stability",
        options=Stability,
        ignored=_ignored,
    )
)
