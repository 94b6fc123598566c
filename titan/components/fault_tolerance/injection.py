"""Faults on purpose, for the tests of fault handling, driven by the `debug` section.

Nothing here runs unless a `debug.*_step` is set: the injector then hooks into the model
(forward hooks) and the checkpointer (its files-written hook), so the training loop itself
carries no test code.
"""

import logging
import os
import signal
import time
from collections.abc import Callable

from torch import nn

logger = logging.getLogger(__name__)


class FaultInjector:
    def __init__(self, cfg, *, rank: int, current_step: Callable[[], int]):
        self.cfg, self.rank, self.current_step = cfg, rank, current_step
        self._slept = False

    @classmethod
    def build(cls, cfg, *, rank: int, current_step: Callable[[], int]) -> "FaultInjector | None":
        """An injector for `cfg` (the debug section), or None when it asks for no fault."""
        wanted = (cfg.nan_at_step, cfg.sleep_at_step, cfg.kill_in_checkpoint_step)
        return cls(cfg, rank=rank, current_step=current_step) if max(wanted) >= 0 else None

    def install(self, model_parts: list[nn.Module]) -> None:
        for part in model_parts:
            if self.cfg.nan_at_step >= 0:
                part.register_forward_hook(self._nan_output)
        if self.cfg.sleep_at_step >= 0 and self.rank == self.cfg.sleep_rank:
            model_parts[0].register_forward_pre_hook(self._sleep)

    def _nan_output(self, module, args, output):
        # a NaN output makes the loss and every gradient NaN, as a diverged step would
        if self.current_step() == self.cfg.nan_at_step:
            return output * float("nan")
        return None

    def _sleep(self, module, args):
        step = self.current_step()
        due = (
            step >= self.cfg.sleep_at_step
            if self.cfg.sleep_every_step
            else step == self.cfg.sleep_at_step and not self._slept
        )
        if due:
            self._slept = True
            logger.warning(
                "debug.sleep_at_step: rank %d sleeps %.3gs", self.rank, self.cfg.sleep_seconds
            )
            time.sleep(self.cfg.sleep_seconds)

    def on_checkpoint_phase(self, phase: str, step: int) -> None:
        """Die as a save starts writing this rank's files, or once they are written before the
        save is marked complete (debug.kill_in_checkpoint_phase; first launch only, so a
        restarted job gets past it)."""
        if (
            step == self.cfg.kill_in_checkpoint_step
            and self.rank == self.cfg.kill_rank
            and phase == self.cfg.kill_in_checkpoint_phase
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        ):
            logger.warning(
                "debug.kill_in_checkpoint_step: rank %d kills itself now (%s)", self.rank, phase
            )
            os.kill(os.getpid(), signal.SIGKILL)
