"""CUDA memory snapshots, from the profiling section: the caching allocator records every
allocation (with its stack) from `memory_snapshot_start_step`, and the history is dumped to
`<dump_folder>/<save_memory_snapshot_folder>/iteration_<N>/rank<R>_memory_snapshot.pickle`
after every `profile_freq`-th step, and to `iteration_<N>_exit/` when step N runs out of
memory, before the error ends the process. Drop a pickle on https://pytorch.org/memory_viz.
"""

import contextlib
import logging
import os
import pickle

import torch

from titan.components.training.callbacks import Callback

logger = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # allocator events kept: the newest, enough for several steps of a big model


class MemorySnapshot(Callback):
    def __init__(self, cfg, *, dump_folder: str, rank: int):
        self.start, self.freq, self.rank = cfg.memory_snapshot_start_step, cfg.profile_freq, rank
        self.folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.recording = False

    def around_step(self, run, step: int):
        return self.step(step)

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one training step: starts recording at the start step, dumps after every
        profile_freq-th step, and dumps an out-of-memory step before re-raising."""
        if step >= self.start and not self.recording:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
            self.recording = True
        try:
            yield
        except torch.OutOfMemoryError:
            if self.recording:
                self.dump(f"iteration_{step}_exit")
            raise
        if self.recording and step % self.freq == 0:
            self.dump(f"iteration_{step}")

    def dump(self, name: str) -> str:
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info("memory snapshot written to %s", path)
        return path

    def close(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False


def build_callback(run, options) -> MemorySnapshot | None:
    cfg = run.job.profiling
    if not cfg.enable_memory_snapshot:
        return None
    return MemorySnapshot(cfg, dump_folder=run.job.job.dump_folder, rank=run.rank)
