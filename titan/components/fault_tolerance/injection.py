"""Faults on purpose, for the tests of fault handling, driven by the `debug` section.

Nothing here runs unless a `debug.*_step` is set: the injector then hooks into the model
(forward hooks), the data (it wraps the batches' iterator) and the checkpointer (its
files-written hook), so the training loop itself carries no test code.
"""

import logging
import os
import signal
import time
from collections.abc import Callable

import torch
from torch import nn

from titan.components.data.batch import INPUT_IDS, LABELS

logger = logging.getLogger(__name__)


class FaultInjector:
    def __init__(
        self,
        cfg,
        *,
        rank: int,
        current_step: Callable[[], int],
        vocab_size: int = 0,
        first_sample: int = 0,
        bos_id: int | None = None,
    ):
        self.cfg, self.rank, self.current_step = cfg, rank, current_step
        self.vocab_size = vocab_size
        # this rank's first sample's position in each global batch
        self.first_sample, self.bos_id = first_sample, bos_id
        self._slept = self._perturbed = False

    @classmethod
    def build(cls, cfg, **kw) -> "FaultInjector | None":
        """An injector for `cfg` (the debug section), or None when it asks for no fault."""
        wanted = (
            cfg.nan_at_step,
            cfg.bad_batch_at_step,
            cfg.bad_document_at_step,
            cfg.perturb_grads_at_step,
            cfg.sleep_at_step,
            cfg.kill_in_checkpoint_step,
        )
        if max(wanted) < 0:
            return None
        return cls(cfg, **kw)

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

    def batches(self, data):
        """The data iterator `data`, with debug.bad_batch_at_step's batch corrupted as a run
        of one repeated token is (the vocabulary's last id, which real text rarely holds): its
        inputs and counted labels all that id, on every layout alike; `data` itself when no
        batch is to be corrupted."""
        if max(self.cfg.bad_batch_at_step, self.cfg.bad_document_at_step) < 0:
            return data
        return self._corrupting(data)

    def _corrupting(self, data):
        step, row = None, 0  # the step's samples so far on this rank
        for batch in data:
            if self.current_step() != step:
                step, row = self.current_step(), 0
            if step == self.cfg.bad_batch_at_step:
                batch = dict(batch)
                for key in (INPUT_IDS, LABELS):
                    ids = batch[key]
                    batch[key] = torch.where(ids >= 0, self.vocab_size - 1, ids)
            if step == self.cfg.bad_document_at_step:
                at = self.cfg.bad_document_sample - self.first_sample - row
                if 0 <= at < batch[INPUT_IDS].shape[0]:
                    batch = self._corrupt_document(batch, at)
            row += batch[INPUT_IDS].shape[0]
            yield batch

    def _corrupt_document(self, batch: dict, row: int) -> dict:
        """The tokens of the document the sample's first label predicts, up to the next BOS
        (kept), made the vocabulary's last id in the inputs and in the labels that predict
        them; labels not counted stay so."""
        inputs, labels = batch[INPUT_IDS].clone(), batch[LABELS].clone()
        # window position p: inputs[p], and the token that labels[p - 1] predicts
        window = torch.cat([inputs[row], labels[row, -1:]])
        opens = (window[2:] == self.bos_id).nonzero()
        end = int(opens[0]) + 2 if len(opens) else len(window)
        p = torch.arange(len(window))
        bad = (p >= 1) & (p < end) & (window != self.bos_id)
        window = torch.where(bad, self.vocab_size - 1, window)
        inputs[row] = window[:-1]
        labels[row] = torch.where(labels[row] >= 0, window[1:], labels[row])
        logger.warning(
            "debug.bad_document_at_step: sample %d's labels 0-%d corrupted",
            self.first_sample + row,
            end - 2,
        )
        return {**batch, INPUT_IDS: inputs, LABELS: labels}

    def after_backward(self, params: list[torch.Tensor]) -> None:
        """debug.perturb_grads_at_step: debug.perturb_rank's gradient shards x100, once (a
        replay of the step computes them right)."""
        cfg = self.cfg
        if self.current_step() != cfg.perturb_grads_at_step or self.rank != cfg.perturb_rank:
            return
        if self._perturbed:
            return
        self._perturbed = True
        logger.warning("debug.perturb_grads_at_step: rank %d's gradients x100", self.rank)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(100.0)

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
