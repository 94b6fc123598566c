"""Held-out loss during training, with its own data, batch size and normalization.

The validation loss is the mean cross-entropy per token over the whole validation pass (or
its first `validation.steps` batches of `validation.global_batch_size` sequences): every rank
sums its token losses and counts its tokens, and both are summed over all ranks at the end.
The sequences validated are those of whole global batches, dp rank r taking the r-th slice of
each (in forwards of `validation.local_batch_size`), so with the global batch size set the
loss does not depend on the training batch, the layout, or the forwards' size.

Streamed datasets have no global index: each dp rank reads its own shard, and the shards
end at different batches. The ranks agree after every batch whether all of them still have
one, so no rank enters a collective (FSDP's all-gathers, TP, PP) that another skips.
"""

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan.components.data.batch import to_device
from titan.components.data.dataloader import (
    DataShard,
    build_chat_dataloader,
    build_image_dataloader,
    build_text_dataloader,
)
from titan.components.data.dataset import DataError
from titan.components.data.tokenizer import Tokenizer
from titan.components.training.callbacks import Callback, StepEnd
from titan.components.training.loss import sum_over

logger = logging.getLogger(__name__)

# a batch (titan.components.data.batch) -> (this rank's summed token cross-entropy, the
# tokens it covers)
LossSum = Callable[..., tuple[torch.Tensor, float]]


class Validator:
    def __init__(
        self,
        cfg,
        *,
        global_batch_size: int,
        local_batch_size: int,
        tokenizer: Tokenizer,
        seq_len: int,
        text_field: str,
        seed: int,
        shard: DataShard,
        model_parts: list[nn.Module],
        loss_sum: LossSum,
        sum_groups: list[dist.ProcessGroup | None],
        device: torch.device,
        chat=None,
        images=None,
        vision=None,
    ):
        """`cfg`: the validation section; the batch sizes as the run plan resolved them.
        `sum_groups`: the process groups over which the loss sums and token counts add up
        (pipeline stages, dp x cp ranks). `chat`: the chat section, when the data are
        conversations (as the training data's); `images` and `vision`: the images section and
        the model's tower, when the data are image-text records."""
        self.cfg = cfg
        self.model_parts, self.loss_sum = model_parts, loss_sum
        self.sum_groups, self.device = sum_groups, device
        self.local_batch_size = local_batch_size
        # a rank's forwards per validation batch
        self.forwards = global_batch_size // (local_batch_size * shard.dp_world_size)
        if chat is not None:
            build, own = build_chat_dataloader, {"chat": chat}
        elif images is not None:
            build = build_image_dataloader
            own = {"images": images, "vision": vision, "text_field": text_field}
        else:
            build = build_text_dataloader
            own = {"text_field": text_field, "streaming": cfg.dataset_streaming}
        self.loader = build(
            dataset=cfg.dataset,
            dataset_path=cfg.dataset_path,
            tokenizer=tokenizer,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            global_batch_size=global_batch_size,
            shard=shard,
            seed=seed,
            shuffle=False,
            infinite=False,
            section="validation",
            **own,
        )
        self.streamed = not self.loader.global_index

    def due(self, step: int, last_step: int) -> bool:
        return step % self.cfg.freq == 0 or step == last_step

    @torch.no_grad()
    def run(self) -> tuple[float, int]:
        """Validate; returns (the loss, this rank's forwards)."""
        self.loader.rewind()
        for part in self.model_parts:
            part.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        batches = 0
        batch_iter = iter(self.loader)
        while self.cfg.steps == -1 or batches < self.cfg.steps * self.forwards:
            batch = next(batch_iter, None)
            if not self._every_rank_has(batch is not None):
                break
            loss_sum, tokens = self.loss_sum(to_device(batch, self.device))
            totals[0] += loss_sum.double()
            totals[1] += tokens
            batches += 1
        for part in self.model_parts:
            part.train()
        if batches == 0:
            raise DataError(
                f"validation dataset {self.cfg.dataset!r} has fewer sequences than one "
                f"validation batch ({self.local_batch_size * self.forwards} per rank); lower "
                "validation.global_batch_size"
            )
        sum_over(totals, self.sum_groups)
        return (totals[0] / totals[1]).item(), batches

    def _every_rank_has(self, has_batch: bool) -> bool:
        if not self.streamed or not dist.is_initialized() or dist.get_world_size() == 1:
            return has_batch
        flag = torch.tensor(int(has_batch), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)


class ValidationCallback(Callback):
    """Validates after every `validation.freq`-th step and the last; its time is kept out of
    tokens/s."""

    def __init__(self, validator: Validator, last_step: int):
        self.validator, self.last_step = validator, last_step

    def on_step_end(self, run, end: StepEnd) -> None:
        if not self.validator.due(end.step, self.last_step):
            return
        t0 = time.perf_counter()
        with run.callbacks.around_scoring(run, "validation") as named:
            loss, batches = self.validator.run()
        run.metrics.log_validation(end.step, loss, batches, of=", ".join(named) or None)
        run.exclude_time(time.perf_counter() - t0)
        run.notify("on_validation_end", end.step, loss, batches)


def build_callback(run, options) -> ValidationCallback | None:
    job = run.job
    if not job.validation.enable:
        return None
    t = job.training
    validator = Validator(
        job.validation,
        global_batch_size=run.plan.validation_global_batch,
        local_batch_size=run.plan.validation_local_batch,
        tokenizer=run.plan.tokenizer,
        seq_len=t.seq_len,
        text_field=t.dataset_text_field,
        seed=t.seed,
        shard=run.data_shard,
        model_parts=run.model_parts,
        loss_sum=run.eval_loss_sum,
        sum_groups=run.loss_groups,
        device=run.device,
        chat=job.chat if t.dataset_format == "chat" else None,
        images=job.images if t.dataset_format == "images" else None,
        vision=getattr(run.plan.model_args, "vision", None),
    )
    return ValidationCallback(validator, t.steps)
