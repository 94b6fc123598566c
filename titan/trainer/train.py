"""The trainer: `python -m titan.trainer [overrides]`, normally started by run_train.sh.

Read top to bottom: build everything from the config, then loop over steps.
"""

import functools
import logging
import os
import signal
import sys
import time

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import record

from titan.assembly import build
from titan.assembly.microbatch import ForwardBackward
from titan.assembly.replay import StepInputs
from titan.components.checkpoint.checkpointer import SaveInterrupted, stop_save_process
from titan.components.checkpoint.folders import CheckpointError, step_folder
from titan.components.checkpoint.train_state import DataState, ModelState, TrainState
from titan.components.converters import Converters
from titan.components.data.batch import INPUT_IDS, LABELS, to_device
from titan.components.data.dataset import DataError
from titan.components.fault_tolerance import interrupts
from titan.components.fault_tolerance.watchdog import StepWatchdog
from titan.components.observability.metrics import input_costs
from titan.components.optim.grad_clip import clip_grad_norm_
from titan.components.optim.optimizer import build_optimizer
from titan.components.training.callbacks import StepEnd, StopTraining, build_callbacks
from titan.components.training.step_figures import StepFigures, StepGuard
from titan.config import ConfigError, JobConfig, help_text, parse_args, to_toml, with_config_file
from titan.parallelisms.tensor_parallel import shard_grads_like_params
from titan.plan.run_plan import RunPlan, plan_run
from titan.runtime import final_error
from titan.runtime.console import plural, print_out
from titan.runtime.distributed import (
    clean_exit,
    is_collective_failure,
)
from titan.runtime.logging_setup import init_logging, quiet_checkpoint_process
from titan.trainer.run_view import RunView

logger = logging.getLogger("titan")


class Trainer:
    """Builds a run from its config and plan (titan.assembly.build), then trains it: each step
    forward -> backward -> clip -> step -> log, the components told through their seams."""

    def __init__(self, job: JobConfig, plan: RunPlan):
        self.job, self.plan = job, plan
        t = job.training
        self.device, self.rank, self.world_size = build.process(job, plan)
        self.step = self.skipped_steps = 0
        self.converters = Converters(job)
        self.shard = build.data_shard(job, plan)
        self.dataloader = build.dataloader(job, plan, self.shard)
        self.model_parts, self.pp_plan, self.tied_copies = build.materialized_parts(
            job, plan, self.converters, self.device
        )
        self.fwd_bwd = ForwardBackward(job, plan, self.model_parts, self.pp_plan, self.device)
        self.flops_per_token = functools.cache(plan.model_args.flops_per_token)
        self.faults = build.fault_injector(
            job, plan, self.rank, self.shard, self.model_parts, lambda: self.step
        )
        build.describe(job, plan, self.pp_plan, self.converters, self.model_parts)
        # the groups a rank's loss sums over: pipeline stages, dp x cp ranks (None: 1 rank)
        pp = plan.dims.group("pp") if self.pp_plan is not None else None
        self.loss_groups = (pp, plan.dims.group("dp_cp"))
        self.optimizer = build_optimizer(
            self.model_parts, job.optimizer, job.extensions, self.converters.lr_scale
        )
        self.post_optimizer_hooks = build.post_optimizer_hooks(
            job, plan, self.converters, self.model_parts
        )
        self.hook_metrics: dict = {}  # what the hooks report of the last step (MoE loads)
        self.guard = StepGuard(self.device, nonfinite_stops=t.on_nonfinite == "stop")
        self.lr_scheduler = build.lr_scheduler(job, plan, self.optimizer)
        self.train_state = TrainState()
        # built before the resume: the checkpoint holds their states
        self.run_view = RunView(self)
        self.callbacks = self.train_state.callbacks = build_callbacks(self.run_view, job.extensions)
        # the host reads every step's figures only for a component that decides on them
        self.reads_each_step = bool(self.callbacks.judges) or t.on_nonfinite == "skip"
        self.step_inputs = self.figures = None  # the step's, for a replay
        states = {
            "model": self.converters.model_state(self.model_parts),
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "dataloader": DataState(self.dataloader, self.shard.dp_rank, self.shard.dp_world_size),
            "train_state": self.train_state,
        }
        self.checkpointer = build.checkpointer(
            job, plan, self.converters, self.rank, self.model_parts, states, self.faults
        )
        self.checkpointer.load()
        self.step = self.train_state.step
        states = {**states, "model": ModelState(self.model_parts)}
        del states["dataloader"]  # a healing peer continues at its own step's batch
        self.ft = build.fault_tolerance(job, self.device, self.model_parts, states, self._on_heal)
        self.metrics = build.metrics_logger(job, plan, self.device)

    def _on_heal(self) -> None:
        """A live peer's state was loaded mid-step: continue from its step and data position."""
        self.step = self.train_state.step + 1
        self.dataloader.seek_global_batch(self.step)
        logger.info("torchft: healed from a live replica group; continuing at step %d", self.step)

    # ------------------------------------------------------------------ one step

    def train_step(self, microbatches, shape) -> tuple[StepFigures, bool]:
        """One optimizer step over the microbatches of a step of `shape`: (its figures, left
        on the device; whether its update was skipped)."""
        if self.ft is not None:
            self.checkpointer.wait_for_staging()  # a heal may overwrite the parameters
            self.ft.start_step()  # the quorum forms while forward/backward run
        # the loss is the mean over the labels the data counts, however many that is
        labels = [b[LABELS] for b in microbatches]
        counted = self.fwd_bwd.objective.count(labels, self.plan.dims.group("dp"))
        if self.callbacks.replay:
            self.step_inputs = StepInputs.keep(microbatches, self.device)
        self.shape = shape
        self.figures = figures = self.gradients(microbatches, counted)
        self.guard.watch(self.step, figures)
        reason = self._skip_reason(figures)
        if reason is not None:
            logger.warning("step %d: optimizer step skipped: %s", self.step, reason)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            # an async checkpoint's copy of the parameters overlaps forward/backward, not this
            self.checkpointer.wait_for_staging()
            self.optimizer.step()
        for hook in self.post_optimizer_hooks:  # a skipped step's routing moves no bias
            self.hook_metrics.update(hook(reason is None) or {})
        self.lr_scheduler.step()
        return figures, reason is not None

    def _skip_reason(self, figures: StepFigures) -> str | None:
        """Why this step's update is not taken, or None. The host reads the step's figures
        here only where a component decides on them (training.on_nonfinite = "skip", a
        callback's judge_step); otherwise the guard watches them on the device."""
        # collective within the group: every rank asks, whatever it will do with the answer
        if self.ft is not None and not self.ft.should_commit():
            return "torchft quorum did not commit"
        if not self.reads_each_step:
            return None
        if not figures.finite:  # under on_nonfinite = "stop", reading them raised already
            return f"non-finite loss {figures.loss} / grad norm {figures.grad_norm}"
        reasons = (
            cb.judge_step(self.run_view, self.step, figures.loss, figures.grad_norm)
            for cb in self.callbacks.judges
        )
        return next((r for r in reasons if r is not None), None)

    def gradients(self, microbatches, counted, replay: bool = False) -> StepFigures:
        """Forward and backward of the step's microbatches, the gradients clipped: the
        step's figures (global loss and terms, global gradient norm), on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        objective = self.fwd_bwd.objective
        weight = 1 / (len(microbatches) * self.fwd_bwd.pipeline_microbatches)
        with objective.step(weight, self.fwd_bwd.token_split(self.shape)):
            for batch in microbatches:
                self.fwd_bwd.step(to_device(batch, self.device))
        shard_grads_like_params([p for part in self.model_parts for p in part.parameters()])
        if self.tied_copies is not None:  # pipeline stages' copies of one tied weight
            self.tied_copies.sum_grads()
        params, copies = self.grad_params()
        if self.faults is not None and not replay:
            self.faults.after_backward(params)
        max_norm, pp = self.job.training.max_norm, self.loss_groups[0]
        grad_norm = clip_grad_norm_(params, max_norm, extra_group=pp, uncounted=copies)
        values = objective.reduce(*self.loss_groups)
        return StepFigures(objective.names, values, grad_norm, counted)

    def grad_params(self) -> tuple[list, list]:
        """(the parameters the gradient norm counts, pipeline copies of a tied weight)."""
        params = [p for part in self.model_parts for p in part.parameters()]
        if self.tied_copies is None:
            return params, []
        return self.tied_copies.split(params)

    def next_microbatches(self, data_iter, shape):
        """The step's microbatches: as many as its global batch (of `shape`) holds on this
        rank (a schedule regroups the stream from the step whose shape changes)."""
        if self.plan.batch_schedule is not None or self.plan.seq_len_schedule is not None:
            self.dataloader.resize(shape.windows, shape.pieces, shape.local_batch)
        return [next(data_iter) for _ in range(shape.grad_accum)]

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        t, job, view = self.job.training, self.job, self.run_view
        if job.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True, blocking=True)
            logger.info("seed checkpoint written; start training with checkpoint.enable")
            return
        first_step = self.step + 1
        watchdog = build.watchdog(job, self.rank)
        data_iter = iter(self.dataloader)
        if self.faults is not None:
            data_iter = self.faults.batches(data_iter)
        build.describe_batches(job, self.plan)
        self.callbacks.emit(view, "on_train_start")
        while self.step < t.steps:
            self.step += 1
            started_ns, t0 = time.time_ns(), time.perf_counter()
            shape = self.plan.step_shape(self.step)
            microbatches = self.next_microbatches(data_iter, shape)
            data_s = time.perf_counter() - t0
            # counted before the step: context parallelism shards the batch in place
            batch_tokens = sum(b[INPUT_IDS].numel() for b in microbatches)
            # optimizer.lr on its schedule (a param group's own lr follows the same factor)
            lr = self.job.optimizer.lr * self.lr_scheduler.last_factor
            with self.callbacks.around_step(view, self.step):
                figures, skipped = self.train_step(microbatches, shape)
            self.skipped_steps += skipped
            if self.step == first_step:  # start-up and compilation are slow, no step after
                build.steady_state(job, watchdog)
            self.train_state.step = self.step
            self.train_state.tokens_seen += batch_tokens * self.plan.data_parallel_size
            # tp/cp/pp ranks share their batch: count each token once per device group
            tokens = batch_tokens // self.plan.dims.non_dp
            extra, kinds = input_costs(self.plan.model_args, microbatches)
            flops = self.flops_per_token(shape.seq_len) + extra / batch_tokens
            kinds = {k: n // self.plan.dims.non_dp for k, n in kinds.items()}
            self.metrics.record_step(tokens, data_s, started_ns, flops, kinds)
            logged = None
            if self.metrics.should_log(self.step, t.steps):
                logged = self._log_step(figures, lr)
            seen = self.train_state.tokens_seen
            end = StepEnd(self.step, figures, lr, skipped, seen, logged)
            self.callbacks.emit(view, "on_step_end", end)
            stop = self.step == t.exit_at_step or view.stop_reason is not None
            self._save_if_due(stop, watchdog, figures, requested=view.save_requested)
            view.save_requested = False
            watchdog.progress(f"step {self.step}")
            if stop:
                why = view.stop_reason or "training.exit_at_step"
                logger.info("stopping after step %d (%s)", self.step, why)
                break
        if self.step >= first_step:  # the guard's word on the steps no one read
            figures.read()
        self.callbacks.emit(view, "on_train_end")
        watchdog.stop()
        logger.info("training done after %s", plural(self.step, "step"))

    def _log_step(self, figures: StepFigures, lr: float) -> dict:
        loss, grad_norm = figures.loss, figures.grad_norm  # read first: the guard may raise
        extra = self.callbacks.figures(self.run_view, self.step)  # what they measured of it
        if self.skipped_steps:
            extra["skipped_steps"] = self.skipped_steps
        # the objective's terms beside the cross-entropy `loss` (the model's own too), and
        # what the hooks measured (already the same on every rank)
        extra.update(figures.terms)
        extra.update(self.fwd_bwd.objective.model_terms())
        extra.update(self.hook_metrics)
        mix = self.dataloader.source_tokens(self.job.training.seq_len)
        if mix is not None:  # the realized mix of weighted sources
            extra["source_tokens"] = mix
        return self.metrics.log(
            self.step, loss, grad_norm, lr, tokens_seen=self.train_state.tokens_seen, **extra
        )

    def _save_if_due(
        self, stop: bool, watchdog: StepWatchdog, figures: StepFigures, requested: bool = False
    ) -> None:
        """The step's checkpoint, if one is due or a callback asked for it; the last step's
        and an exit's block. Nothing is saved of a run the guard stops (figures.read)."""
        final = self.step == self.job.training.steps
        ck = self.job.checkpoint
        due = self.checkpointer.due(self.step, last=final or stop)
        if not (due or (requested and ck.enable)):
            return
        figures.read()
        model_only = final and (ck.last_save_model_only or ck.last_save_in_hf)
        with watchdog.paused(), self.callbacks.around_export(self.run_view, model_only):
            self.metrics.exclude(
                self.checkpointer.save(self.step, model_only=model_only, blocking=final or stop)
            )
        path = step_folder(self.checkpointer.root, self.step)
        self.callbacks.emit(self.run_view, "on_checkpoint_saved", self.step, str(path))

    def stopping(self, error: BaseException) -> None:
        """The run ends with `error`: tell the callbacks (on this rank only)."""
        self.callbacks.stopping(self.run_view, error)

    def close(self) -> None:
        if self.ft is not None:
            self.ft.shutdown()
        self.checkpointer.close()
        self.callbacks.close()


@record  # torchrun's failure summary then shows this rank's exception
def run(job: JobConfig, plan: RunPlan) -> None:
    trainer = Trainer(job, plan)
    interrupts.track(lambda: trainer.step)
    try:
        trainer.train()
    except BaseException as e:
        trainer.stopping(e)
        if isinstance(e, interrupts.Interrupted) or interrupts.received():
            # stopping: nothing waits for peers (an async save, a closing barrier) that are
            # stopping too; a save in flight stays incomplete, which a resume skips
            stop_save_process(kill=True)
            raise
        if is_collective_failure(e):
            logger.error(
                "rank %d: a collective failed during step %d (timed out, or a peer closed the "
                "connection): another rank is stuck or has died. Look for its watchdog report "
                "(%s/watchdog/rank*_stacks.txt) or its error above; comm.train_timeout_seconds "
                "sets the limit.",
                trainer.rank,
                trainer.step,
                job.job.dump_folder,
            )
        trainer.close()
        raise
    trainer.close()


# errors a restart would meet again: (kind, exit code), handed to the launcher
FINAL_ERRORS = {
    ConfigError: ("config error", 2),
    DataError: ("data error", 2),
    CheckpointError: ("checkpoint error", 2),
    StopTraining: ("training stopped", 1),  # a NonFiniteLossError too
}


def main(argv: list[str] | None = None) -> None:
    interrupts.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    init_logging()
    try:
        if "--help" in argv or "-h" in argv:
            print_out(help_text(with_config_file(argv)))
            sys.exit(0)
        # run_train.sh names a config; without one, this entry trains what run_train.sh would
        job = parse_args(with_config_file(argv))
        plan = plan_run(job, starting=True)
    except ConfigError as e:
        print(f"titan: config error: {e}", file=sys.stderr)
        final_error.record("config error", e, 2)
        sys.exit(2)
    if job.job.print_config and int(os.environ.get("RANK", "0")) == 0:
        print(to_toml(job), flush=True)
    code = 0
    try:
        run(job, plan)
    except tuple(FINAL_ERRORS) as e:
        logger.error("%s", e)
        kind, code = next(v for cls, v in FINAL_ERRORS.items() if isinstance(e, cls))
        final_error.record(kind, e, code)
    # DCP's CheckpointException is a BaseException: a failed load or save is reported too
    except (Exception, CheckpointException, interrupts.Interrupted) as e:
        try:
            code = _report(e, job)
        except interrupts.Interrupted as stop:  # the signal came while reporting: say that
            code = _report(stop, job)
    clean_exit(code)


def _report(e: BaseException, job: JobConfig) -> int:
    """One line for how a run that raised ended; its exit code."""
    signum = interrupts.received()
    if signum is None and isinstance(e, SaveInterrupted):
        # a peer died mid-save: a rank failure torchrun restarts, said in one line
        logger.error("%s; a restart (MAX_RESTARTS) resumes from it", e)
        return 1
    if signum is None and is_collective_failure(e):
        return 1  # run() said which step and where to look; the stack adds nothing
    if signum is None:
        logger.exception("training failed")
        return 1
    # a collective a stopping peer left is part of the stop, wherever the signal landed
    step = interrupts.step_at_signal()
    peer = final_error.peer_failure() if signum == signal.SIGTERM else None
    logger.warning(
        "stopped %s %s; %s",
        f"by torchrun as a peer failed ({peer})" if peer else f"by {final_error.describe(signum)}",
        f"during step {step}" if step else "before the first step",
        interrupts.status(job.checkpoint, job.job.dump_folder),
    )
    return 128 + signum


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # DCP's saving process, spawned from here, imports it first
    quiet_checkpoint_process()
