"""torch profiler traces every `profile_freq` steps, one file per rank and traced step."""

import contextlib
import logging
import os

import torch

from titan.components.training.callbacks import Callback, StepEnd

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def maybe_profile(cfg, *, trace_dir: str, rank: int, first_step: int = 1):
    """Yields a profiler to `.step()` once per training step, or None when `cfg` (the
    profiling section) does not enable it."""
    if not cfg.enable_profiling:
        yield None
        return
    profile_freq, warmup, active = cfg.profile_freq, cfg.profiler_warmup, cfg.profiler_active
    os.makedirs(trace_dir, exist_ok=True)
    steps_done = [first_step - 1]

    def on_trace_ready(prof):
        step = steps_done[0]
        folder = os.path.join(trace_dir, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}_trace.json")
        prof.export_chrome_trace(path)
        logger.info("profiler trace for step %d written to %s", step, path)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_initialized():  # training on a GPU
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(
        wait=profile_freq - warmup - active,
        warmup=warmup,
        active=active,
        skip_first=(first_step - 1) % profile_freq,
    )
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=on_trace_ready
    ) as prof:
        original_step = prof.step

        def step():
            steps_done[0] += 1
            original_step()

        prof.step = step
        yield prof


class ProfilerCallback(Callback):
    """Traces every `profiling.profile_freq`-th step (maybe_profile's schedule)."""

    def __init__(self, cfg, trace_dir: str, rank: int):
        self.cfg, self.trace_dir, self.rank = cfg, trace_dir, rank
        self.stack = contextlib.ExitStack()
        self.prof = None

    def on_train_start(self, run) -> None:
        self.prof = self.stack.enter_context(
            maybe_profile(
                self.cfg, trace_dir=self.trace_dir, rank=self.rank, first_step=run.step + 1
            )
        )

    def on_step_end(self, run, end: StepEnd) -> None:
        self.prof.step()

    def on_train_end(self, run) -> None:
        self.stack.close()

    def close(self) -> None:
        self.stack.close()


def build_callback(run, options) -> ProfilerCallback | None:
    cfg = run.job.profiling
    if not cfg.enable_profiling:
        return None
    trace_dir = os.path.join(run.job.job.dump_folder, cfg.save_traces_folder)
    return ProfilerCallback(cfg, trace_dir, run.rank)
