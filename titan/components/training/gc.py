"""Garbage collection on a fixed schedule: automatic GC pauses at random points on every rank
and desynchronizes collectives, so it is off during training and run after every
`training.gc_freq`-th step; its seconds are the logged `gc_s` (since the last logged step)."""

import contextlib
import gc
import time

from titan.components.training.callbacks import Callback


class ScheduledGC(Callback):
    def __init__(self, gc_freq: int):
        self.gc_freq = gc_freq
        self.seconds = 0.0  # collecting, since the last logged step

    def on_train_start(self, run) -> None:
        gc.disable()
        collect()

    def around_step(self, run, step: int):
        return self._collect_after() if step % self.gc_freq == 0 else None

    @contextlib.contextmanager
    def _collect_after(self):
        yield
        self.seconds += collect()

    def figures(self, run, step: int) -> dict:
        seconds, self.seconds = self.seconds, 0.0
        return {"gc_s": seconds}

    def on_train_end(self, run) -> None:
        gc.enable()

    def close(self) -> None:
        gc.enable()


def collect() -> float:
    t0 = time.perf_counter()
    gc.collect(1)
    return time.perf_counter() - t0


def build_callback(run, options) -> ScheduledGC:
    return ScheduledGC(run.job.training.gc_freq)
