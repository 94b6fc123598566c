"""A training step's global figures, left on the device until someone reads them.

A read (`.item()`, `.tolist()`) makes the host wait for the device: on a GPU the host can then
no longer queue the next step's kernels while this one runs, and a step with a read cannot be
captured in a CUDA graph. So the step hands its figures on as tensors; the host reads them at
a logged step, before a checkpoint, or when a component asks (a spike monitor's judgement, a
`training.on_nonfinite = "skip"` decision), all of them in one copy.

The checks every step needs (a global batch with no counted label, a non-finite loss or
gradient norm under `on_nonfinite = "stop"`) are kept on the device too: `StepGuard` records
the first bad step's figures with tensor operations, and the next read raises its error. The
run then stops at the next read point instead of at the bad step itself: the steps between
are trained and thrown away, as nothing of them is logged or saved.
"""

import math

import torch

from titan.components.training.callbacks import StopTraining
from titan.components.training.objective import Objective

# StepGuard's record: (step, what went wrong, loss, grad norm) of the first bad step
_FINE, _NOTHING_COUNTED, _NON_FINITE = 0, 1, 2


class NonFiniteLossError(StopTraining):
    pass


class StepGuard:
    """The first step with nothing counted, or non-finite figures where they stop the run,
    recorded on the device; `raise_for(record)` turns a read record into its error."""

    def __init__(self, device: torch.device, nonfinite_stops: bool):
        self.nonfinite_stops = nonfinite_stops
        self.record = torch.zeros(4, dtype=torch.float64, device=device)

    def watch(self, step: int, figures: "StepFigures") -> None:
        """Record `figures` of `step` if it is the first bad one, and have them raise its
        error when read."""
        figures.guard = self
        loss, norm = figures.values[0].double(), figures.norm.double()
        kind = torch.where(figures.counted == 0, _NOTHING_COUNTED, _FINE)
        if self.nonfinite_stops:
            finite = torch.isfinite(loss) & torch.isfinite(norm)
            kind = torch.where((kind == _FINE) & ~finite, _NON_FINITE, kind)
        # torch.full fills on the device: no copy from the host, nothing waits
        at = torch.full((), step, dtype=torch.float64, device=self.record.device)
        now = torch.stack([at, kind.double(), loss, norm])
        first = (self.record[1] == _FINE) & (kind != _FINE)
        self.record = torch.where(first, now, self.record)

    @staticmethod
    def raise_for(record: list[float]) -> None:
        step, kind, loss, norm = record
        if kind == _NOTHING_COUNTED:
            raise Objective.nothing_counted(int(step))
        if kind == _NON_FINITE:
            raise NonFiniteLossError(
                f"non-finite loss ({loss}) or grad norm ({norm}) at step {int(step)}; "
                "lower optimizer.lr, check the data, or set training.on_nonfinite = 'skip'"
            )


class StepFigures:
    """The step's `loss` and objective terms (an Objective's `names`, `loss` first, summed
    over the run) and its gradient norm, on the device, with its count of labels (for a
    replay and the guard); `read()` copies the figures (and the guard's record, raising its
    error) to the host in one read, once."""

    def __init__(
        self,
        names: list[str],
        values: torch.Tensor,
        grad_norm: torch.Tensor,
        counted: torch.Tensor,
        guard: StepGuard | None = None,
    ):
        self.names, self.values, self.norm, self.counted = names, values, grad_norm, counted
        self.guard = guard
        self._host: list[float] | None = None

    def read(self) -> list[float]:
        if self._host is None:
            parts = [self.values.double(), self.norm.double().reshape(1)]
            if self.guard is not None:
                parts.append(self.guard.record)
            self._host = torch.cat([p.to(self.values.device) for p in parts]).tolist()
        if self.guard is not None:
            StepGuard.raise_for(self._host[len(self.names) + 1 :])
        return self._host

    @property
    def loss(self) -> float:
        return self.read()[0]

    @property
    def grad_norm(self) -> float:
        return self.read()[len(self.names)]

    @property
    def terms(self) -> dict[str, float]:
        """The objective's terms beside `loss` (the cross-entropy), unweighted."""
        return dict(zip(self.names[1:], self.read()[1 : len(self.names)], strict=True))

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)
