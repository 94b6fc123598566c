"""Garbage collection on a fixed schedule: automatic GC pauses at random points on every rank
and desynchronizes collectives, so it is off during training and run every `gc_freq` steps."""

import gc
import time


class ScheduledGC:
    def __init__(self, gc_freq: int):
        self.gc_freq = gc_freq
        gc.disable()
        self.collect()

    def step(self, step: int) -> float:
        """Collect if due at this step; returns the seconds it took (0 if not due)."""
        return self.collect() if step % self.gc_freq == 0 else 0.0

    @staticmethod
    def collect() -> float:
        t0 = time.perf_counter()
        gc.collect(1)
        return time.perf_counter() - t0

    @staticmethod
    def close() -> None:
        gc.enable()
