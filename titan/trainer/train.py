"""The trainer: `python -m titan.trainer [overrides]`, normally started by run_train.sh.

Read top to bottom: build everything from the config, then loop over steps.
"""

import contextlib
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import record

from titan.components.checkpoint.checkpointer import (
    Checkpointer,
    SaveInterrupted,
    stop_save_process,
)
from titan.components.checkpoint.folders import CheckpointError, step_folder
from titan.components.checkpoint.hf_io import HFModelIO
from titan.components.checkpoint.train_state import DataState, ModelState, TrainState
from titan.components.checkpoint.trained_with import trained_with
from titan.components.converters import Converters
from titan.components.data.batch import INPUT_IDS, LABELS, to_device
from titan.components.data.dataloader import DataShard, build_dataloader
from titan.components.data.dataset import DataError
from titan.components.fault_tolerance.injection import FaultInjector
from titan.components.fault_tolerance.watchdog import StepWatchdog
from titan.components.observability.flight_recorder import configure_flight_recorder
from titan.components.observability.flops import peak_flops
from titan.components.observability.metrics import MetricsLogger
from titan.components.optim.grad_clip import clip_grad_norm_
from titan.components.optim.lr_scheduler import build_lr_scheduler
from titan.components.optim.optimizer import build_optimizer
from titan.components.training.callbacks import Callback, StepEnd, StopTraining, build_callbacks
from titan.components.training.step_figures import StepFigures, StepGuard
from titan.config import ConfigError, JobConfig, help_text, parse_args, to_toml, with_config_file
from titan.parallelisms.tensor_parallel import shard_grads_like_params
from titan.parallelisms.tied_weights import TiedCopies
from titan.parallelisms.token_split import token_split
from titan.plan.run_plan import RunPlan, plan_run
from titan.runtime import final_error
from titan.runtime.console import plural, print_out
from titan.runtime.distributed import (
    clean_exit,
    init_distributed,
    is_collective_failure,
    pick_device,
    set_collective_timeout,
)
from titan.runtime.dtypes import to_dtype
from titan.runtime.logging_setup import init_logging, quiet_checkpoint_process
from titan.trainer import interrupts
from titan.trainer.build import meta_parts, run_identity, training_save_bytes
from titan.trainer.microbatch import ForwardBackward
from titan.trainer.replay import (
    Replay,
    StepInputs,
    copies,
    gather_rank_norms,
    local_grad_sq,
    unclipped,
)
from titan.trainer.run_view import RunView

logger = logging.getLogger("titan")


class Trainer:
    def __init__(self, job: JobConfig, plan: RunPlan):
        self.job, self.plan = job, plan
        t, dims = job.training, plan.dims
        self.device = pick_device(t.device)
        keep_step = job.metrics.per_rank and dims.world_size > 1
        configure_flight_recorder(job.comm, job.job.dump_folder, self.device.type, keep_step)
        self.rank, self.world_size = init_distributed(self.device, job.comm.init_timeout_seconds)
        set_determinism(t.seed, t.deterministic, compiling=job.compile.enable)
        dims.build_mesh(self.device.type)
        self.step = 0
        self.skipped_steps = 0

        self.converters = Converters(job)
        self.shard = self._data_shard()
        self.dataloader = build_dataloader(
            t,
            tokenizer=plan.tokenizer,
            shard=self.shard,
            global_batch_size=plan.global_batch_size,
            sections=job.extensions,
        )
        self.model_parts, self.pp_plan, self.tied_copies = self._build_model()
        self.fwd_bwd = ForwardBackward(job, plan, self.model_parts, self.pp_plan, self.device)
        self._token_splits: dict[tuple[int, int], object] = {}
        self._flops: dict[int, float] = {}
        self.faults = FaultInjector.build(
            job.debug,
            rank=self.rank,
            current_step=lambda: self.step,
            vocab_size=plan.model_args.vocab_size,
            first_sample=self.shard.dp_rank * (plan.global_batch_size // plan.data_parallel_size),
            bos_id=plan.tokenizer.bos_id,
        )
        if self.faults is not None:
            self.faults.install(self.model_parts)
        self._log_model()

        self.optimizer = build_optimizer(
            self.model_parts, job.optimizer, job.extensions, self.converters.lr_scale
        )
        self.post_optimizer_hooks = self._post_optimizer_hooks()
        self.guard = StepGuard(self.device, nonfinite_stops=t.on_nonfinite == "stop")
        self.hook_metrics: dict = {}  # what the hooks report of the last step (MoE loads)
        schedule = plan.batch_schedule
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            job.lr_scheduler,
            t.steps,
            scale=schedule.lr_factor if schedule and schedule.lr_scaling != "none" else None,
        )

        self.train_state = TrainState()
        # built before the resume: the checkpoint holds their states
        self.run_view = RunView(self)
        self.callbacks = build_callbacks(self.run_view, job.extensions)
        self.train_state.callbacks = self.callbacks
        # the host reads every step's figures only for a component that decides on them
        self.judges = [cb for cb in self.callbacks.values() if _overrides(cb, "judge_step")]
        self.reads_each_step = bool(self.judges) or t.on_nonfinite == "skip"
        self.keeps_step_inputs = any(cb.replays for cb in self.callbacks.values())
        self.checkpointer = self._checkpointer()
        self.checkpointer.load()
        self.step = self.train_state.step
        self.ft = self._fault_tolerance()

        self.metrics = self._metrics_logger()

    # ------------------------------------------------------------------ building

    def _log_model(self) -> None:
        job, plan, args, pp = self.job, self.plan, self.plan.model_args, self.pp_plan
        active = args.num_params(active=True)
        logger.info(
            "model %s %s: %.3fM parameters%s, layout %s, grad accumulation %d%s",
            job.model.name,
            job.model.flavor,
            args.num_params() / 1e6,
            f" ({active / 1e6:.3f}M active)" if active != args.num_params() else "",
            plan.dims,
            plan.grad_accum_steps,
            f", pipeline stages {pp.stage_ids} of {pp.num_stages} "
            f"({pp.schedule}, {pp.n_microbatches} microbatches)"
            if pp
            else "",
        )
        self.converters.describe(self.model_parts, pipelined=pp is not None)

    def _post_optimizer_hooks(self) -> list:
        """Run after every step, in order, told whether the optimizer stepped: the converters'
        (scales of the new weights, say), then the family's (an MoE's router-bias update)."""
        family = (make(self.model_parts, self.job) for make in self.plan.spec.post_optimizer_hooks)
        return self.converters.post_optimizer_hooks(self.model_parts) + [h for h in family if h]

    def _checkpointer(self) -> Checkpointer:
        job, plan = self.job, self.plan
        return Checkpointer(
            job.checkpoint,
            dump_folder=job.job.dump_folder,
            rank=self.rank,
            layout=plan.layout(),
            identity=run_identity(job, plan, self.converters),
            save_bytes=training_save_bytes(job, plan, self.converters),
            states={
                "model": self.converters.model_state(self.model_parts),
                "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler,
                "dataloader": DataState(
                    self.dataloader, self.shard.dp_rank, self.shard.dp_world_size
                ),
                "train_state": self.train_state,
            },
            hf=HFModelIO(plan.spec, plan.model_args, plan.tokenizer)
            if plan.spec.state_dict_adapter
            else None,
            on_save_phase=self.faults.on_checkpoint_phase if self.faults else None,
            on_export=self.converters.exporter(self.model_parts, plan.spec, plan.model_args),
            trained_with=trained_with(
                job.optimizer.name, plan.tokenizer, self.converters.parametrization()
            ),
        )

    def _metrics_logger(self) -> MetricsLogger:
        m, t = self.job.metrics, self.job.training
        peak, peak_source = peak_flops(self.device, to_dtype(t.mixed_precision_param), m.peak_flops)
        if peak is None:
            logger.info("MFU %s", peak_source)
        else:
            logger.info("MFU is relative to %.4g TFLOP/s (%s)", peak / 1e12, peak_source)
        return MetricsLogger(
            m,
            device=self.device,
            flops_per_token=self._flops_per_token(t.seq_len),
            peak_flops=peak,
            max_over_ranks=self._max_over_ranks,
            total_steps=t.steps,
        )

    def _flops_per_token(self, seq_len: int) -> float:
        """A token's training FLOPs in a sequence of `seq_len` (attention grows with it)."""
        if seq_len not in self._flops:
            self._flops[seq_len] = self.plan.model_args.flops_per_token(seq_len)
        return self._flops[seq_len]

    def _data_shard(self) -> DataShard:
        """This rank's slice of each global batch; torchft groups extend the dp dimension."""
        ft = self.job.fault_tolerance
        group = ft.replica_id if ft.enable else 0
        dp_mesh = self.plan.dims["dp"]
        return DataShard(
            group * dp_mesh.size() + dp_mesh.get_local_rank(), self.plan.data_parallel_size
        )

    def _build_model(self):
        """Meta-device model -> pipeline stages (if pp) -> parallelisms -> real memory -> init."""
        job = self.job
        whole, parts, pp_plan = meta_parts(job, self.plan, self.converters)
        for part in parts:
            part.to_empty(device=self.device)
            # weights come from (seed, parameter name): identical whatever the layout
            part.init_weights(job.training.seed, buffer_device=self.device)
            self.converters.init_weights(part, job.training.seed)
            part.train()
        tied = None
        if pp_plan is not None and whole.tied_parameters():
            last = pp_plan.num_stages - 1
            split = last not in self.plan.pipeline(0).stage_ids
            tied = TiedCopies(parts, whole.tied_parameters(), self.plan.dims.world_mesh, split)
        return parts, pp_plan, tied

    def _fault_tolerance(self):
        if not self.job.fault_tolerance.enable:
            return None
        from titan.components.fault_tolerance.torchft_groups import FaultTolerance

        ft = FaultTolerance(self.job.fault_tolerance, device=self.device)
        ft.average_gradients_across_groups(self.model_parts)
        ft.register_state(
            {
                "model": ModelState(self.model_parts),
                "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler,
                "train_state": self.train_state,
            },
            on_heal=self._on_heal,
        )
        return ft

    def _on_heal(self) -> None:
        """A live peer's state was loaded mid-step: continue from its step and data position."""
        self.step = self.train_state.step + 1
        self.dataloader.seek_global_batch(self.step)
        logger.info("torchft: healed from a live replica group; continuing at step %d", self.step)

    def pp_group(self) -> dist.ProcessGroup | None:
        return self.plan.dims["pp"].get_group() if self.pp_plan is not None else None

    def dp_cp_group(self) -> dist.ProcessGroup | None:
        return self._group("dp_cp")

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of the mesh dimension `dim`; None where it is 1 rank."""
        mesh = self.plan.dims[dim]
        return mesh.get_group() if mesh.size() > 1 else None

    def _max_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor(value, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    # ------------------------------------------------------------------ one step

    def train_step(self, microbatches, shape) -> tuple[StepFigures, bool]:
        """One optimizer step over the microbatches of a step of `shape`: (its figures, left
        on the device; whether its update was skipped)."""
        if self.ft is not None:
            self.checkpointer.wait_for_staging()  # a heal may overwrite the parameters
            self.ft.start_step()  # the quorum forms while forward/backward run
        # the loss is the mean over the labels the data counts, however many that is
        counted = self.fwd_bwd.objective.count([b[LABELS] for b in microbatches], self._group("dp"))
        if self.keeps_step_inputs:  # a callback replays steps
            self.step_inputs = StepInputs.keep(microbatches, self.device)
        self.shape = shape
        self.figures = figures = self.gradients(microbatches, counted)
        self.guard.watch(self.step, figures.values, figures.norm, counted)
        figures.guard = self.guard
        reason = self._skip_reason(figures)
        if reason is not None:
            logger.warning("step %d: optimizer step skipped: %s", self.step, reason)
            self.optimizer.zero_grad(set_to_none=True)
            for hook in self.post_optimizer_hooks:  # its routing counts move no bias
                hook(False)
            self.lr_scheduler.step()
            return figures, True
        # an async checkpoint's copy of the parameters overlaps forward/backward, not this
        self.checkpointer.wait_for_staging()
        self.optimizer.step()
        for hook in self.post_optimizer_hooks:
            self.hook_metrics.update(hook(True) or {})
        self.lr_scheduler.step()
        return figures, False

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
            for cb in self.judges
        )
        return next((r for r in reasons if r is not None), None)

    def gradients(self, microbatches, counted, replay: bool = False) -> StepFigures:
        """Forward and backward of the step's microbatches, the gradients clipped: the
        step's figures (global loss and terms, global gradient norm), on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        objective = self.fwd_bwd.objective
        weight = 1 / (len(microbatches) * self.fwd_bwd.pipeline_microbatches)
        with objective.step(weight, self.token_split(self.shape)):
            for batch in microbatches:
                self.fwd_bwd.step(to_device(batch, self.device))
        shard_grads_like_params([p for part in self.model_parts for p in part.parameters()])
        if self.tied_copies is not None:  # pipeline stages' copies of one tied weight
            self.tied_copies.sum_grads()
        params, copies = self.grad_params()
        if self.faults is not None and not replay:
            self.faults.after_backward(params)
        grad_norm = clip_grad_norm_(
            params, self.job.training.max_norm, extra_group=self.pp_group(), uncounted=copies
        )
        values = objective.reduce(self.pp_group(), self.dp_cp_group())
        return StepFigures(objective.names, values, grad_norm, counted)

    def token_split(self, shape):
        """What the model's group losses (MoE balancing) need to know of the layout, for a
        step of this shape."""
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

    def grad_params(self) -> tuple[list, list]:
        """(the parameters the gradient norm counts, pipeline copies of a tied weight)."""
        params = [p for part in self.model_parts for p in part.parameters()]
        if self.tied_copies is None:
            return params, []
        return self.tied_copies.split(params)

    def replay_step(self, edit=None) -> Replay:
        """This step again from its batch and random state (see titan.trainer.replay), its
        microbatches first given to `edit` when given; the gradients left are the replay's."""
        if not self.keeps_step_inputs:
            raise RuntimeError(
                "replay_step: no callback of this run says it replays steps (its `replays` "
                "attribute), so the step's inputs were not kept"
            )
        max_norm, figures = self.job.training.max_norm, self.figures
        first = unclipped(local_grad_sq(self.grad_params()[0]), figures.grad_norm, max_norm)
        self.step_inputs.rng.restore(self.device)
        replay = copies(self.step_inputs.microbatches)
        if edit is not None:
            replay = edit(replay)
        again = self.gradients(replay, figures.counted, replay=True)
        second = unclipped(local_grad_sq(self.grad_params()[0]), again.grad_norm, max_norm)
        return Replay(again.loss, again.grad_norm, gather_rank_norms(first, second, self.device))

    def next_microbatches(self, data_iter, shape):
        """The step's microbatches: as many as its global batch (of `shape`) holds on this
        rank (a schedule regroups the stream from the step whose shape changes)."""
        if self.plan.batch_schedule is not None or self.plan.seq_len_schedule is not None:
            self.dataloader.resize(shape.windows, shape.pieces, shape.local_batch)
        return [next(data_iter) for _ in range(shape.grad_accum)]

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        t, job = self.job.training, self.job
        if job.job.description:
            logger.info("job: %s", job.job.description)
        if job.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True, blocking=True)
            logger.info("seed checkpoint written; start training with checkpoint.enable")
            return
        first_step = self.step + 1
        # at 80% of the collective timeout, so a stuck rank reports itself before its peers'
        # collectives time out (they only know that *someone* is late)
        watchdog = StepWatchdog(
            0.8 * job.comm.train_timeout_seconds, self.rank, job.job.dump_folder
        )
        data_iter = iter(self.dataloader)
        if self.faults is not None:
            data_iter = self.faults.batches(data_iter)
        schedule, lengths = self.plan.batch_schedule, self.plan.seq_len_schedule
        logger.info(
            "training %s, global batch %d sequences x %d tokens%s%s",
            plural(t.steps, "step"),
            self.plan.global_batch_size,
            t.seq_len,
            f" (scheduled: {', '.join(f'{s} from step {a}' for a, s in schedule.entries)}; "
            f"lr scaling {schedule.lr_scaling})"
            if schedule
            else "",
            f"; sequence lengths {', '.join(f'{n} from step {a}' for a, n in lengths.entries)}"
            f" (a step keeps its {lengths.keeps})"
            if lengths
            else "",
        )
        view = self.run_view
        self.emit("on_train_start")
        while self.step < t.steps:
            self.step += 1
            started_ns = time.time_ns()
            t0 = time.perf_counter()
            shape = self.plan.step_shape(self.step)
            microbatches = self.next_microbatches(data_iter, shape)
            data_s = time.perf_counter() - t0
            # counted before the step: context parallelism shards the batch in place
            batch_tokens = sum(b[INPUT_IDS].numel() for b in microbatches)
            # optimizer.lr on its schedule (a param group's own lr follows the same factor)
            lr = self.job.optimizer.lr * self.lr_scheduler.last_factor
            with self._around_step():
                figures, skipped = self.train_step(microbatches, shape)
            self.skipped_steps += skipped
            if self.step == first_step:
                self._after_first_step(watchdog)
            self.train_state.step = self.step
            self.train_state.tokens_seen += batch_tokens * self.plan.data_parallel_size
            # tp/cp/pp ranks share their batch: count each token once per device group
            self.metrics.record_step(
                batch_tokens // self.plan.dims.non_dp,
                data_s,
                started_ns,
                flops_per_token=self._flops_per_token(shape.seq_len),
            )
            logged = None
            if self.metrics.should_log(self.step, t.steps):
                logged = self._log_step(figures, lr)
            tokens = self.train_state.tokens_seen
            self.emit("on_step_end", StepEnd(self.step, figures, lr, skipped, tokens, logged))
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
        self.emit("on_train_end")
        watchdog.stop()
        logger.info("training done after %s", plural(self.step, "step"))

    def _after_first_step(self, watchdog: StepWatchdog) -> None:
        # start-up and compilation are slow; steady-state steps are not
        timeout = self.job.comm.train_timeout_seconds
        set_collective_timeout(timeout)
        logger.info("collective timeout now %ds (comm.train_timeout_seconds)", timeout)
        watchdog.start()

    def emit(self, event: str, *args) -> None:
        """Call `event` of every callback, in registration order."""
        for callback in self.callbacks.values():
            getattr(callback, event)(self.run_view, *args)

    def _around_step(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for callback in self.callbacks.values():
            context = callback.around_step(self.run_view, self.step)
            if context is not None:
                stack.enter_context(context)
        return stack

    def _around_export(self, export: bool) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for callback in self.callbacks.values() if export else ():
            context = callback.around_export(self.run_view)
            if context is not None:
                stack.enter_context(context)
        return stack

    def _log_step(self, figures: StepFigures, lr: float) -> dict:
        loss, grad_norm = figures.loss, figures.grad_norm  # read first: the guard may raise
        extra = {}
        for callback in self.callbacks.values():  # what they measured of the step
            extra.update(callback.figures(self.run_view, self.step) or {})
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
        with watchdog.paused(), self._around_export(model_only):
            self.metrics.exclude(
                self.checkpointer.save(self.step, model_only=model_only, blocking=final or stop)
            )
        path = step_folder(self.checkpointer.root, self.step)
        self.emit("on_checkpoint_saved", self.step, str(path))

    def stopping(self, error: BaseException) -> None:
        """The run ends with `error`: tell the callbacks (on this rank only)."""
        for callback in self.callbacks.values():
            try:
                callback.on_stop(self.run_view, error)
            except Exception:  # noqa: BLE001  the run's own error is the one to report
                logger.exception("callback %s failed in on_stop", type(callback).__name__)

    def close(self) -> None:
        if self.ft is not None:
            self.ft.shutdown()
        self.checkpointer.close()
        for callback in self.callbacks.values():
            callback.close()


def _overrides(callback: Callback, method: str) -> bool:
    return getattr(type(callback), method) is not getattr(Callback, method)


def set_determinism(seed: int, deterministic: bool, compiling: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if compiling or "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # the public call imports inductor (1.4 s a rank on 2 CPU cores) only to set
            # inductor's own flag, which nothing reads unless the model is compiled
            torch._C._set_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


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
        plan = plan_run(job)
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
    logger.warning(
        "stopped by %s %s; %s",
        final_error.describe(signum),
        f"during step {step}" if step else "before the first step",
        interrupts.status(job.checkpoint, job.job.dump_folder),
    )
    return 128 + signum


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # DCP's saving process, spawned from here, imports it first
    quiet_checkpoint_process()
