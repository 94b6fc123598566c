"""Forward and backward of one batch on this rank's model parts: the loss, the context-parallel
and loss-parallel contexts, document masks and the pipeline schedule around them.

The trainer runs it on real tensors; the memory planner (titan.planner.activations) runs the same
forward on fake ones, so the activations it counts are the ones the run keeps.
"""

import contextlib

import torch
from torch import nn

from titan.components.data.batch import INPUT_IDS, LABELS, Batch, extra_fields
from titan.components.training.loss import IGNORE_INDEX, plain
from titan.components.training.objective import Objective
from titan.components.training.terms import build_terms
from titan.config import JobConfig
from titan.models.common.documents import document_kwargs
from titan.parallelisms.context_parallel import context_parallel_ctx
from titan.parallelisms.parallel_dims import heads_group_size
from titan.parallelisms.pipeline import (
    PipelinePlan,
    build_schedule,
    held_between_actions,
    schedule_stages,
)
from titan.parallelisms.token_split import token_split
from titan.plan.run_plan import RunPlan


class ForwardBackward:
    def __init__(
        self,
        job: JobConfig,
        plan: RunPlan,
        parts: list[nn.Module],
        pp_plan: PipelinePlan | None,
        device: torch.device,
    ):
        self.job, self.plan, self.parts, self.pp_plan, self.device = (
            job,
            plan,
            parts,
            pp_plan,
            device,
        )
        t, dims = job.training, plan.dims
        # each cp rank holds 1/cp of every sequence; FSDP averages grads over dp x cp ranks.
        # Every step counts its own (Objective.count); unmasked, the global batch's tokens
        tokens = plan.global_batch_size // plan.data_parallel_size * t.seq_len // dims.cp
        sums = self._output_takes_labels()  # a chunked loss's output layer computes them
        self.objective = Objective(build_terms(job), tokens, dims.cp, device, output_sums=sums)
        self.loss_parallel = dims.tp_enabled and not job.parallelism.disable_loss_parallel
        # FSDP casts parameters itself; a single replica needs autocast for bf16 compute
        bf16_autocast = t.mixed_precision_param == "bfloat16" and not dims.fsdp_enabled
        self.amp = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if bf16_autocast
            else contextlib.nullcontext
        )
        self.schedule = self._schedule(pp_plan, self.objective.loss)
        # a stage infers its shapes once: one schedule per microbatch shape (a schedule of
        # sequence lengths changes it), the first built here
        self._schedules: dict[tuple, object] = {}
        # forwards per microbatch of the step: a schedule splits each into its own
        self.pipeline_microbatches = pp_plan.n_microbatches if pp_plan is not None else 1
        self.eval_schedule = None  # built at the first validation
        self._token_splits: dict[tuple[int, int], object] = {}
        self._scorer = None

    def _schedule(self, pp_plan, loss_fn):
        if pp_plan is None:
            return None
        return build_schedule(
            self.parts,
            pp_plan,
            self.plan.dims["pp"],
            self.device,
            loss_fn,
            inference_ctx=self.objective.paused,
        )

    def token_split(self, shape):
        """What the model's group losses (MoE balancing) need to know of the layout, for a
        step of this shape (titan.plan.run_plan.StepShape)."""
        key = (shape.sequences, shape.seq_len)
        if key not in self._token_splits:
            self._token_splits[key] = token_split(
                self.plan.dims,
                sequence_parallel=self.job.parallelism.enable_sequence_parallel,
                global_batch_size=shape.sequences,
                seq_len=shape.seq_len,
                data_parallel_size=self.plan.data_parallel_size,
            )
        return self._token_splits[key]

    def _pipeline_schedules(self) -> list:
        return list({id(s): s for s in (self.schedule, *self._schedules.values()) if s}.values())

    def held_between_actions(self) -> list[torch.Tensor]:
        """What this rank's pipeline schedules hold that a backward made (none without one)."""
        return [t for s in self._pipeline_schedules() for t in held_between_actions(s)]

    def before_weight_backward(self, callback) -> None:
        """Call `callback` before every stage's weight backward (None: no more)."""
        for schedule in self._pipeline_schedules():
            for stage in schedule_stages(schedule):
                stage.before_weight_backward = callback

    def loss_parallel_ctx(self):
        return (
            torch.distributed.tensor.parallel.loss_parallel()
            if self.loss_parallel
            else contextlib.nullcontext()
        )

    def cp_ctx(self, *batch: torch.Tensor | None, kwargs: dict | None = None):
        """Shard the batch, the model's batch-shaped arguments (documents and their positions)
        and every part's CP buffers along the sequence. With document positions the RoPE
        table stays whole: its rows are picked by position, not by place."""
        dims = self.plan.dims
        if not dims.cp_enabled:
            return contextlib.nullcontext()
        par = self.job.parallelism
        batch = [b for b in batch if b is not None]
        # a row field (a row's images) stays whole: the ranks of a CP group see the same rows
        rows = getattr(self.parts[0], "row_fields", ())
        kwargs = {k: v for k, v in (kwargs or {}).items() if k not in rows}
        batch += [t for t in kwargs.values() if all(t is not b for b in batch)]
        buffers = (
            []
            if "positions" in kwargs
            else [pair for part in self.parts for pair in part.cp_buffers()]
        )
        return context_parallel_ctx(
            dims["cp"],
            batch + [b for b, _ in buffers],
            [1] * len(batch) + [d for _, d in buffers],
            set(batch),
            par.context_parallel_rotate_method,
            par.context_parallel_load_balance,
            heads_group=heads_group_size(par, dims.cp),
        )

    def _output_takes_labels(self) -> bool:
        """Whether an output layer of this rank computes the loss itself, given the labels:
        any of its parts (a V-shaped pipeline puts the last stage second on rank 0)."""
        outputs = [getattr(p, "output", None) for p in self.parts]
        return any(getattr(o, "takes_labels", False) for o in outputs)

    def model_kwargs(self, batch: Batch) -> dict:
        """The model's arguments beside the tokens: the batch's fields its family takes
        (`batch_fields`), the documents when attention is block-causal, and the labels when
        the model trains on them in forward (`takes_labels`) or its output layer computes
        the loss."""
        m, model = self.job.model, self.parts[0]
        out = {k: v for k, v in extra_fields(batch).items() if k in model.batch_fields}
        if model.takes_labels or self._output_takes_labels():
            out[LABELS] = batch[LABELS]
        if m.attn_mask_type == "block_causal":
            bos = self.plan.tokenizer.bos_id
            for name, t in document_kwargs(batch, m.document_positions, bos).items():
                out.setdefault(name, t)  # the batch's own positions (images') stand
        rows, width = batch[INPUT_IDS].shape
        if self.plan.dims.cp_enabled and width < self.job.training.seq_len:
            # context parallelism shards the RoPE table by place, as long as training.seq_len:
            # a shorter sequence picks its rows by position instead
            positions = torch.arange(width, device=self.device).repeat(rows, 1)
            out.setdefault("positions", positions)
        return out

    def forward_loss(self, batch: Batch, kwargs: dict, target: torch.Tensor) -> torch.Tensor:
        """The loss of one microbatch, ready for backward; call inside cp_ctx and
        loss_parallel_ctx. `kwargs` and `target`: the batch's model_kwargs and its objective's
        target, made before cp_ctx shards them."""
        with self.amp():
            logits = self.parts[0](batch[INPUT_IDS], **kwargs)
        return self.objective.loss(logits, target)

    def forward_backward(self, batch: Batch) -> None:
        """Forward and backward of one microbatch (its terms go to `objective`)."""
        kwargs = self.model_kwargs(batch)  # documents of the whole sequences
        target = self.objective.target(batch)
        with self.cp_ctx(batch[INPUT_IDS], target, kwargs=kwargs), self.loss_parallel_ctx():
            self.forward_loss(batch, kwargs, target).backward()

    def run_pipeline(self, schedule, batch: Batch, train: bool = True) -> torch.Tensor:
        """Run `schedule` over one batch; the loss sum is nonzero only where the last stage is."""
        last = self.pp_plan.num_stages - 1
        has_first, has_last = 0 in self.pp_plan.stage_ids, last in self.pp_plan.stage_ids
        losses = [] if has_last else None
        run = schedule.step if train else schedule.eval
        kwargs = self.model_kwargs(batch)  # every stage's attention needs them
        inputs = batch[INPUT_IDS] if has_first else None
        # validation's loss is the cross-entropy alone: the labels
        target = (self.objective.target(batch) if train else batch[LABELS]) if has_last else None
        with self.cp_ctx(inputs, target, kwargs=kwargs), self.loss_parallel_ctx():
            run(
                *((inputs,) if has_first else ()),
                target=target,
                losses=losses,
                # the losses come back through `losses`: no stage keeps its outputs for a
                # merge nothing reads (the last stage's logits are freed after its loss)
                return_outputs=False,
                **kwargs,
            )
        total = torch.zeros((), device=self.device)
        for loss in losses or []:
            total += plain(loss.detach())
        return total

    def step(self, batch: Batch) -> None:
        """Forward and backward of one microbatch of the step (all of a pipeline's); its terms
        go to `objective`."""
        if self.schedule is not None:
            shape = tuple(batch[INPUT_IDS].shape)
            if not self._schedules:
                self._schedules[shape] = self.schedule
            elif shape not in self._schedules:
                self._schedules[shape] = self._schedule(self.pp_plan, self.objective.loss)
            self.run_pipeline(self._schedules[shape], batch)
        else:
            self.forward_backward(batch)

    def logits(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """The model's logits of a (batch, seq) batch of tokens, with a decode cache for
        generation (one model part: without pipelining or context parallelism); a DTensor
        under loss parallelism."""
        with self.amp():
            return self.parts[0](tokens, cache=cache)

    def token_scores(self, tokens: torch.Tensor, targets: torch.Tensor):
        """(each target's log-probability, the most likely token) at each position of a
        (batch, seq) batch, on every rank of any layout (titan.assembly.scoring)."""
        if self._scorer is None:
            from titan.assembly.scoring import TokenScorer

            self._scorer = TokenScorer(self)
        return self._scorer(tokens, targets)

    @property
    def decodes(self) -> bool:
        """Whether `logits` takes a decode cache on this layout (one part, whole sequences)."""
        dims, par = self.plan.dims, self.job.parallelism
        split = dims.cp_enabled or (dims.tp_enabled and par.enable_sequence_parallel)
        return self.pp_plan is None and not split

    def eval_loss_sum(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """This rank's summed token cross-entropy over a validation batch and its share of the
        counted tokens (counted before context parallelism shards the batch; 0 off the last
        pipeline stage)."""
        labels = batch[LABELS]
        tokens = int((labels != IGNORE_INDEX).sum()) / self.plan.dims.cp
        if self.pp_plan is not None:
            if self.eval_schedule is None:
                plan = self.plan.pipeline(self.plan.dims["pp"].get_local_rank(), validation=True)
                self.eval_schedule = self._schedule(plan, self.objective.cross_entropy)
            has_last = self.pp_plan.num_stages - 1 in self.pp_plan.stage_ids
            loss = self.run_pipeline(self.eval_schedule, batch, train=False)
            return loss, tokens if has_last else 0
        kwargs = self.model_kwargs(batch)
        inputs = batch[INPUT_IDS]
        with self.cp_ctx(inputs, labels, kwargs=kwargs), self.loss_parallel_ctx(), self.amp():
            loss = self.objective.cross_entropy(self.parts[0](inputs, **kwargs), labels)
        return plain(loss), tokens
