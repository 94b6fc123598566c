"""The trainer: `python -m titan.train [overrides]`, normally started by run_train.sh.

Read top to bottom: build everything from the config, then loop over steps.
"""

import contextlib
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan.components.checkpoint import Checkpointer, DataState, ModelState, TrainState
from titan.components.dataloader import DataShard, build_dataloader
from titan.components.dataset import DataError
from titan.components.fault_tolerance import FaultTolerance
from titan.components.flops import peak_flops
from titan.components.hf_io import CheckpointError
from titan.components.gc import ScheduledGC
from titan.components.grad_clip import clip_grad_norm_
from titan.components.lr_scheduler import build_lr_scheduler
from titan.components.metrics import MetricsLogger
from titan.components.optimizer import build_optimizer
from titan.components.profiling import maybe_profile
from titan.components.watchdog import StepWatchdog, record_for_torchrun
from titan.config import ConfigError, JobConfig, parse_args, to_toml
from titan.distributed import clean_exit, init_distributed, pick_device, set_collective_timeout
from titan.logging_setup import init_logging
from titan.parallelisms.context_parallel import context_parallel_ctx
from titan.parallelisms.pipeline import build_schedule
from titan.preflight import RunPlan, pipeline_plan, plan_run

logger = logging.getLogger("titan")


class NonFiniteLossError(RuntimeError):
    pass


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Loss parallel leaves replicated DTensors; the step's bookkeeping uses plain tensors."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    def __init__(self, job: JobConfig, plan: RunPlan):
        self.job, self.plan = job, plan
        t = job.training
        self.device = pick_device()
        self.rank, self.world_size = init_distributed(self.device, job.comm.init_timeout_seconds)
        self._set_determinism(t.seed, t.deterministic)

        dims = plan.dims
        dims.build_mesh(self.device.type)
        self.dp_mesh = dims["dp"]
        self.loss_mesh = dims["dp_cp"]
        shard = self._data_shard()
        self.dataloader = build_dataloader(
            t.dataset, t.dataset_path, plan.tokenizer, t.seq_len, t.local_batch_size,
            plan.global_batch_size, shard, t.seed, t.dataset_text_field, t.dataset_shuffle,
        )

        # each cp rank holds 1/cp of every sequence; FSDP averages grads over dp x cp ranks
        self.tokens_per_rank_step = (plan.global_batch_size // plan.data_parallel_size
                                     * t.seq_len // dims.cp)
        self.loss_parallel = dims.tp_enabled and not job.parallelism.disable_loss_parallel
        self.model_parts, self.pp_schedule, self.pp_plan = self._build_model(plan, dims, job)
        logger.info("model %s %s: %.3fM parameters, layout %s, grad accumulation %d%s",
                    job.model.name, job.model.flavor, plan.model_args.num_params() / 1e6, dims,
                    plan.grad_accum_steps,
                    f", pipeline stages {self.pp_plan.stage_ids} of {self.pp_plan.num_stages} "
                    f"({self.pp_plan.schedule}, {self.pp_plan.n_microbatches} microbatches)"
                    if self.pp_plan else "")

        o, s = job.optimizer, job.lr_scheduler
        self.optimizer = build_optimizer(self.model_parts, o.name, o.lr, o.beta1, o.beta2, o.eps,
                                         o.weight_decay, o.implementation)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, t.steps, s.warmup_steps,
                                               s.decay_ratio, s.decay_type, s.min_lr_factor)
        self.amp = self._autocast(t.mixed_precision_param, dims.fsdp_enabled)

        self.train_state = TrainState()
        self.checkpointer = Checkpointer(job.checkpoint, job.job.dump_folder, {
            "model": ModelState(self.model_parts), "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler, "dataloader": DataState(self.dataloader, shard.dp_rank),
            "train_state": self.train_state,
        }, self.rank, debug=job.debug)
        resumed = self.checkpointer.load()
        self.step = self.train_state.step
        self.ft = None
        if job.fault_tolerance.enable:
            ft = job.fault_tolerance
            self.ft = FaultTolerance(ft.replica_id, ft.min_replica_size, ft.timeout_seconds,
                                     self.device)
            self.ft.average_gradients_across_groups(self.model_parts)
            self.ft.register_state(
                {"model": ModelState(self.model_parts), "optimizer": self.optimizer,
                 "lr_scheduler": self.lr_scheduler, "train_state": self.train_state},
                on_heal=self._on_heal)

        m = job.metrics
        compute_dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else torch.float32
        peak, peak_source = peak_flops(self.device, compute_dtype, m.peak_flops)
        logger.info("MFU is relative to %.4g TFLOP/s (%s)", peak / 1e12, peak_source)
        self.metrics = MetricsLogger(
            m.log_freq, job.job.dump_folder, m.enable_tensorboard, m.save_tb_folder,
            m.disable_color_printing, is_logging_rank=self.rank == 0, rank=self.rank,
            device=self.device, flops_per_token=plan.model_args.flops_per_token(t.seq_len),
            peak_flops=peak, max_over_ranks=self._max_over_ranks,
            resume_step=self.step if resumed else None,
        )
        self.skipped_steps = 0

    def _data_shard(self) -> DataShard:
        """This rank's slice of each global batch; torchft groups extend the dp dimension."""
        ft = self.job.fault_tolerance
        group = ft.replica_id if ft.enable else 0
        dp = self.dp_mesh.size()
        return DataShard(group * dp + self.dp_mesh.get_local_rank(), self.plan.data_parallel_size)

    def _build_model(self, plan: RunPlan, dims, job):
        """Meta-device model -> pipeline stages (if pp) -> parallelisms -> real memory -> init."""
        with torch.device("meta"):
            whole = plan.spec.model_cls(plan.model_args)
        pp_plan = None
        parts = [whole]
        if dims.pp_enabled:
            pp_plan = pipeline_plan(job, plan.model_args.n_layers, dims["pp"].get_local_rank())
            parts = [plan.spec.pipelining_fn(whole, sid, pp_plan) for sid in pp_plan.stage_ids]
        for i, part in enumerate(parts):
            part = plan.spec.parallelize_fn(part, dims, job)
            part.to_empty(device=self.device)
            # weights come from (seed, parameter name): identical whatever the layout
            part.init_weights(job.training.seed, buffer_device=self.device)
            part.train()
            parts[i] = part
        schedule = None
        if pp_plan is not None:
            schedule = build_schedule(parts, pp_plan, dims["pp"], self.device, self._pp_loss)
        return parts, schedule, pp_plan

    def _on_heal(self) -> None:
        """A live peer's state was loaded mid-step: continue from its step and data position."""
        self.step = self.train_state.step + 1
        self.dataloader.dataset.load_state_dict({"global_batches": self.step, "offset": 0})
        logger.info("torchft: healed from a live replica group; continuing at step %d", self.step)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        loss = cross_entropy_sum(logits, labels) / scale
        if self.step == self.job.debug.nan_at_step:
            loss = loss * float("nan")
        return loss

    def _pp_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # normalized by every token of this rank's step, as in the non-pipelined path
        return self._loss(logits, labels, self.tokens_per_rank_step)

    def _max_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor(value, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    @staticmethod
    def _set_determinism(seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    def _autocast(self, param_dtype: str, fsdp: bool):
        # FSDP casts parameters itself; a single replica needs autocast for bf16 compute
        if param_dtype == "bfloat16" and not fsdp:
            return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext

    def _loss_parallel_ctx(self):
        return (torch.distributed.tensor.parallel.loss_parallel() if self.loss_parallel
                else contextlib.nullcontext())

    def _cp_ctx(self, *batch: torch.Tensor | None):
        """Shard the batch and every stage's RoPE table along the sequence for ring attention."""
        dims = self.plan.dims
        if not dims.cp_enabled:
            return contextlib.nullcontext()
        par = self.job.parallelism
        batch = [b for b in batch if b is not None]
        ropes = [part.rope for part in self.model_parts]
        return context_parallel_ctx(
            dims["cp"], batch + ropes, [1] * len(batch) + [0] * len(ropes), set(batch),
            par.context_parallel_rotate_method, par.context_parallel_load_balance,
        )

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss of one microbatch (already divided by the step's token count), after backward."""
        with self._cp_ctx(inputs, labels), self._loss_parallel_ctx():
            with self.amp():
                logits = self.model_parts[0](inputs)
            loss = self._loss(logits, labels, self.tokens_per_rank_step)
            loss.backward()
        return _plain(loss.detach())

    def pipeline_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor,
                                  train: bool = True) -> torch.Tensor:
        """Run the schedule over one batch; the loss sum is nonzero only where the last stage is."""
        last = self.pp_plan.num_stages - 1
        has_first, has_last = 0 in self.pp_plan.stage_ids, last in self.pp_plan.stage_ids
        losses = [] if has_last else None
        run = self.pp_schedule.step if train else self.pp_schedule.eval
        inputs, labels = (inputs if has_first else None), (labels if has_last else None)
        with self._cp_ctx(inputs, labels), self._loss_parallel_ctx():
            run(*((inputs,) if has_first else ()), target=labels, losses=losses)
        total = torch.zeros((), device=self.device)
        for loss in losses or []:
            total += _plain(loss.detach())
        return total

    def _reduce_loss(self, loss: torch.Tensor) -> None:
        """In place: sum over pipeline stages (only the last one holds the loss), then the
        mean over data-parallel and context-parallel ranks."""
        if self.pp_schedule is not None:
            dist.all_reduce(loss, group=self.plan.dims["pp"].get_group())
        if self.loss_mesh.size() > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.loss_mesh.get_group())

    def train_step(self, microbatches) -> tuple[float, float, bool]:
        """One optimizer step over the microbatches; returns (loss, grad norm, skipped)."""
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        if self.ft is not None:
            self.checkpointer.wait_for_staging()  # a heal may overwrite the parameters
            self.ft.start_step()  # the quorum forms while forward/backward run
        loss = torch.zeros((), device=self.device)
        d = self.job.debug
        if self.step == d.sleep_at_step and self.rank == d.sleep_rank:
            logger.warning("debug.sleep_at_step: rank %d sleeps %.0fs", self.rank, d.sleep_seconds)
            time.sleep(d.sleep_seconds)
        for inputs, labels in microbatches:
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            if self.pp_schedule is not None:
                loss += self.pipeline_forward_backward(inputs, labels)
            else:
                loss += self.forward_backward(inputs, labels)
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_group = self.plan.dims["pp"].get_group() if self.pp_schedule is not None else None
        grad_norm = clip_grad_norm_(params, self.job.training.max_norm, extra_group=pp_group)
        self._reduce_loss(loss)
        loss_v, norm_v = loss.item(), grad_norm.item()
        # collective within the group: every rank asks, whatever it will do with the answer
        if self.ft is not None and not self.ft.should_commit():
            logger.warning("step %d: torchft quorum did not commit; optimizer step skipped",
                           self.step)
            self.lr_scheduler.step()
            return loss_v, norm_v, True
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            if self.job.training.on_nonfinite == "stop":
                raise NonFiniteLossError(
                    f"non-finite loss ({loss_v}) or grad norm ({norm_v}) at step {self.step}; "
                    "lower optimizer.lr, check the data, or set training.on_nonfinite = 'skip'"
                )
            logger.warning("step %d: non-finite loss %s / grad norm %s, optimizer step skipped",
                           self.step, loss_v, norm_v)
            self.optimizer.zero_grad(set_to_none=True)
            self.lr_scheduler.step()
            return loss_v, norm_v, True
        # an async checkpoint's copy of the parameters overlaps forward/backward, not this
        self.checkpointer.wait_for_staging()
        self.optimizer.step()
        self.lr_scheduler.step()
        return loss_v, norm_v, False

    def next_microbatches(self, data_iter):
        return [next(data_iter) for _ in range(self.plan.grad_accum_steps)]

    def train(self) -> None:
        t, p = self.job.training, self.job.profiling
        if self.job.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True, blocking=True)
            logger.info("seed checkpoint written; start training with checkpoint.enable")
            return
        gc_sched = ScheduledGC(t.gc_freq)
        first_step = self.step + 1
        # at 80% of the collective timeout, so a stuck rank reports itself before its peers'
        # collectives time out (they only know that *someone* is late)
        watchdog = StepWatchdog(0.8 * self.job.comm.train_timeout_seconds, self.rank,
                                self.job.job.dump_folder)
        data_iter = iter(self.dataloader)
        trace_dir = os.path.join(self.job.job.dump_folder, p.save_traces_folder)
        logger.info("training %d steps, global batch %d sequences x %d tokens", t.steps,
                    self.plan.global_batch_size, t.seq_len)
        with maybe_profile(p.enable_profiling, trace_dir, self.rank, p.profile_freq,
                           p.profiler_warmup, p.profiler_active, self.step + 1) as prof:
            while self.step < t.steps:
                self.step += 1
                t0 = time.perf_counter()
                microbatches = self.next_microbatches(data_iter)
                data_s = time.perf_counter() - t0
                loss, grad_norm, skipped = self.train_step(microbatches)
                self.skipped_steps += skipped
                if self.step == first_step:
                    # start-up and compilation are slow; steady-state steps are not
                    set_collective_timeout(self.job.comm.train_timeout_seconds)
                    watchdog.start()
                batch_tokens = sum(x.numel() for x, _ in microbatches)
                self.train_state.step = self.step
                self.train_state.tokens_seen += batch_tokens * self.plan.data_parallel_size
                # tp/cp/pp ranks share their batch: count each token once per device group
                tokens = batch_tokens // self.plan.dims.non_dp
                self.metrics.record_step(tokens, data_s, gc_sched.step(self.step))
                if self.metrics.should_log(self.step, t.steps):
                    extra = {"skipped_steps": self.skipped_steps} if self.skipped_steps else {}
                    self.metrics.log(self.step, loss, grad_norm, self.lr, **extra)
                if self._validation_due():
                    self.validate()
                stop = self.step == t.exit_at_step
                if self.checkpointer.due(self.step, last=self.step == t.steps or stop):
                    final = self.step == t.steps
                    model_only = final and self.job.checkpoint.last_save_model_only
                    with watchdog.paused():
                        self.metrics.exclude(self.checkpointer.save(
                            self.step, model_only=model_only, blocking=final or stop))
                watchdog.progress(f"step {self.step}")
                if prof is not None:
                    prof.step()
                if stop:
                    logger.info("stopping after step %d (training.exit_at_step)", self.step)
                    break
        watchdog.stop()
        gc_sched.close()
        logger.info("training done after %d steps", self.step)

    def _validation_due(self) -> bool:
        v = self.job.validation
        return v.enable and (self.step % v.freq == 0 or self.step == self.job.training.steps)

    @torch.no_grad()
    def validate(self) -> None:
        t0 = time.perf_counter()
        v, t = self.job.validation, self.job.training
        if not hasattr(self, "val_loader"):
            shard = self._data_shard()
            self.val_loader = build_dataloader(
                v.dataset, v.dataset_path, self.plan.tokenizer, t.seq_len, v.local_batch_size,
                v.local_batch_size * shard.dp_world_size, shard, t.seed, t.dataset_text_field,
                shuffle=False, infinite=False,
            )
        self.val_loader.dataset.rewind()
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        batches = 0
        for inputs, labels in self.val_loader:
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            n_tokens = labels.numel()  # counted before context parallelism shards it in place
            if self.pp_schedule is not None:
                # the schedule's loss is scaled for a training step; rescale to a per-token mean
                loss = self.pipeline_forward_backward(inputs, labels, train=False)
                total += loss * self.tokens_per_rank_step * self.plan.dims.cp / n_tokens
            else:
                with self._cp_ctx(inputs, labels), self._loss_parallel_ctx(), self.amp():
                    logits = self.model_parts[0](inputs)
                    loss = cross_entropy_sum(logits, labels) / (n_tokens / self.plan.dims.cp)
                total += _plain(loss)
            batches += 1
            if batches == v.steps:
                break
        if batches == 0:
            raise DataError(
                f"validation dataset {v.dataset!r} has fewer sequences than one validation batch "
                f"({v.local_batch_size * self.dp_mesh.size()}); lower validation.local_batch_size"
            )
        loss = total / batches
        self._reduce_loss(loss)
        for part in self.model_parts:
            part.train()
        self.metrics.log_validation(self.step, loss.item(), batches)
        self.metrics.exclude(time.perf_counter() - t0)

    def close(self) -> None:
        if self.ft is not None:
            self.ft.shutdown()
        self.checkpointer.close()
        self.metrics.close()


def main(argv: list[str] | None = None) -> None:
    init_logging()
    try:
        job = parse_args(argv)
        plan = plan_run(job)
    except ConfigError as e:
        print(f"titan: config error: {e}", file=sys.stderr)
        sys.exit(2)
    if job.job.print_config and int(os.environ.get("RANK", "0")) == 0:
        print(to_toml(job), flush=True)
    trainer = None
    code = 0
    try:
        trainer = Trainer(job, plan)
        trainer.train()
    except (NonFiniteLossError, DataError, CheckpointError) as e:
        logger.error("%s", e)
        record_for_torchrun(e)
        code = 1
    except Exception as e:
        logger.exception("training failed")
        if trainer is not None and "timed out" in str(e).lower():
            logger.error(
                "rank %d: a collective timed out during step %d. Another rank is stuck or has "
                "died: look for its watchdog report (%s/watchdog/rank*_stacks.txt) or its error "
                "above. comm.train_timeout_seconds sets the limit.", trainer.rank,
                trainer.step, job.job.dump_folder)
        record_for_torchrun(e)
        code = 1
    finally:
        if trainer is not None:
            trainer.close()
    clean_exit(code)


if __name__ == "__main__":
    main()
