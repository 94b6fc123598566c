"""An exponential moving average of the trained weights ([ema]): kept in float32 beside each
parameter, sharded as it is (FSDP, TP, EP shards; each pipeline stage its own), updated after
each optimizer step, saved in every checkpoint (DTensors: a resume onto another layout
reshards it) and swapped into the model where asked: validation.use_ema and eval.use_ema (the
callbacks' around_scoring, which validation and evaluation enter without naming this one),
and checkpoint.export_ema for the final export (around_export).

Before ema.start_step the average is the weights themselves; from it, every ema.every steps,
avg <- decay x avg + (1 - decay) x weights (a step whose update was skipped changes nothing).
"""

import contextlib
import logging

import torch

from titan.components.observability.memory_measure import local as _local
from titan.components.training.callbacks import Callback, StepEnd
from titan.runtime.names import canonical_name

logger = logging.getLogger("titan")


class EMACallback(Callback):
    def __init__(self, cfg, run):
        self.cfg = cfg
        self.export = run.job.checkpoint.export_ema
        self.parts = run.model_parts
        seen, self.params = set(), {}
        for part in run.model_parts:
            for name, p in part.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params[canonical_name(name)] = p
        with torch.no_grad():
            self.average = {n: p.detach().float().clone() for n, p in self.params.items()}
        self._restored = False  # the average came from a checkpoint
        size = sum(_local(a).numel() * 4 for a in self.average.values())
        logger.info("ema: %.1f MiB of float32 averages on this rank", size / 2**20)

    @property
    def _weights(self) -> list[torch.Tensor]:
        # read each time: FSDP's lazy initialization gives its parameters new local tensors
        return [_local(p) for p in self.params.values()]

    @property
    def _averages(self) -> list[torch.Tensor]:
        return [_local(a) for a in self.average.values()]

    def on_train_start(self, run) -> None:
        # a checkpoint without an average (or none: an initial load's weights, or a fresh
        # start) starts it from the weights as training starts, not as they were built
        if not self._restored:
            with torch.no_grad():
                torch._foreach_copy_(self._averages, [w.float() for w in self._weights])

    @torch.no_grad()
    def on_step_end(self, run, end: StepEnd) -> None:
        if end.skipped:
            return
        c = self.cfg
        if end.step < c.start_step:
            torch._foreach_copy_(self._averages, self._weights)
        elif (end.step - c.start_step) % c.every == 0:
            weights = [w.float() for w in self._weights]  # no copy for float32 weights
            torch._foreach_lerp_(self._averages, weights, 1 - c.decay)

    def around_scoring(self, run, scorer: str):
        use = {"validation": run.job.validation.use_ema, "eval": run.job.eval.use_ema}
        return self.swapped() if use.get(scorer) else None

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the average within (its own weights kept aside, put back after);
        gives its name in a log."""
        weights = self._weights
        with torch.no_grad():
            kept = [w.clone() for w in weights]
            torch._foreach_copy_(weights, self._averages)
        self._reshard()
        try:
            yield "the EMA weights"
        finally:
            with torch.no_grad():
                torch._foreach_copy_(weights, kept)
            self._reshard()

    def _reshard(self) -> None:
        """Drop FSDP's gathered copies of the weights (a module that keeps its parameters
        gathered after a forward would run the next one on the copy, not the shards)."""
        from torch.distributed.fsdp import FSDPModule

        for part in self.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def around_export(self, run):
        return self.swapped() if self.export else None

    def state_dict(self) -> dict:
        return dict(self.average)

    def load_state_dict(self, state: dict) -> None:
        self._restored = True
        with torch.no_grad():
            for name, value in state.items():
                if value is not self.average[name]:
                    _local(self.average[name]).copy_(_local(value))


def build_callback(run, options) -> EMACallback | None:
    return EMACallback(options, run) if options.enable else None
