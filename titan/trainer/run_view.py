"""What a callback sees of the trainer (titan.components.training.callbacks): the run's
config, plan, model and optimizer, the step, and what it may ask for."""

import logging

logger = logging.getLogger("titan")


class RunView:
    def __init__(self, trainer):
        self._trainer = trainer
        self.stop_reason: str | None = None
        self.save_requested = False

    # ---------------------------------------------------------------- what it reads

    @property
    def job(self):
        return self._trainer.job

    @property
    def plan(self):
        """The resolved run plan (titan.plan.run_plan.RunPlan): layout, batch sizes."""
        return self._trainer.plan

    @property
    def step(self) -> int:
        """The last step trained (0 before the first)."""
        return self._trainer.step

    @property
    def rank(self) -> int:
        return self._trainer.rank

    @property
    def world_size(self) -> int:
        return self._trainer.world_size

    @property
    def device(self):
        return self._trainer.device

    @property
    def dump_folder(self) -> str:
        return self._trainer.job.job.dump_folder

    @property
    def model_parts(self) -> list:
        """This rank's model parts (pipeline stages; one part without pipelining)."""
        return self._trainer.model_parts

    @property
    def optimizer(self):
        return self._trainer.optimizer

    @property
    def lr_scheduler(self):
        return self._trainer.lr_scheduler

    @property
    def metrics(self):
        """The MetricsLogger: the step's record and console line, the newest step's times."""
        return self._trainer.metrics

    @property
    def data_shard(self):
        """This rank's slice of each global batch (DataShard)."""
        return self._trainer.shard

    @property
    def eval_loss_sum(self):
        """A named batch, on the device -> (this rank's summed token loss, its tokens), under
        the run's layout (pipeline schedule, context parallelism)."""
        return self._trainer.fwd_bwd.eval_loss_sum

    @property
    def logits(self):
        """tokens (batch, seq), optionally cache= a decode cache -> the model's logits, under
        the run's layout and precision (one model part: no pipelining, no context
        parallelism); every rank of a tensor-parallel or FSDP group calls it alike."""
        return self._trainer.fwd_bwd.logits

    @property
    def history_set_aside(self):
        """Where this run's start moved another history's checkpoints (a run that went back
        with checkpoint.load_step), on rank 0; None: it moved none."""
        return self._trainer.checkpointer.set_aside

    @property
    def held_between_actions(self):
        """() -> the tensors a backward made that this rank's pipeline stages hold between
        their actions (none without pipelining)."""
        return self._trainer.fwd_bwd.held_between_actions

    @property
    def before_weight_backward(self):
        """callback -> None: call `callback()` before every pipeline stage's weight backward
        (None: no more)."""
        return self._trainer.fwd_bwd.before_weight_backward

    @property
    def callbacks(self) -> dict:
        """The run's callbacks by name (those it built: a section that is off has none)."""
        return self._trainer.callbacks

    @property
    def token_scores(self):
        """tokens, targets (batch, seq) -> (each target's log-probability, the most likely
        token) at each position, plain and whole on every rank, on any layout (pipeline
        stages and context-parallel ranks included); every rank of the model's layout calls
        it alike. `logits` with a decode cache only where `decodes`."""
        return self._trainer.fwd_bwd.token_scores

    @property
    def decodes(self) -> bool:
        """Whether `logits` runs here (one model part over whole sequences)."""
        return self._trainer.fwd_bwd.decodes

    @property
    def dp_group(self):
        """The process group of the data-parallel ranks (None where there is one)."""
        return self._trainer.plan.dims.group("dp")

    @property
    def loss_groups(self) -> list:
        """The process groups a rank's loss sum and token count add up over (pipeline
        stages, dp x cp ranks; None where a dimension is 1)."""
        return list(self._trainer.loss_groups)

    # ---------------------------------------------------------------- what it asks for

    def request_stop(self, reason: str) -> None:
        """End the run after this step, saving a checkpoint (where checkpointing is on)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def request_save(self) -> None:
        """Save a checkpoint of this step (where checkpointing is on)."""
        self.save_requested = True

    def replay_step(self, edit=None):
        """Run the current step's forward and backward again, from its batch and random
        state, before its update (from judge_step): a titan.assembly.replay.Replay, the same
        on every rank (collective: every rank calls it). `edit(microbatches)` may change a
        copy of the batch first (mask labels, say); its loss is still over the step's
        counted tokens. The update, if taken, uses the last replay's gradients."""
        from titan.assembly.replay import replay_step

        return replay_step(self._trainer, edit)

    def step_documents(self):
        """The documents of the current step's global batch, by label span
        (titan.components.data.document_index.DocSpan; every rank's samples), or None where
        the data cannot name them."""
        return self._trainer.dataloader.step_documents()

    def exclude_time(self, seconds: float) -> None:
        """Keep time spent outside the step (an evaluation) out of tokens/s."""
        self._trainer.metrics.exclude(seconds)

    def notify(self, event: str, *args) -> None:
        """Tell every callback of an event (`on_validation_end`, say)."""
        self._trainer.callbacks.emit(self, event, *args)
