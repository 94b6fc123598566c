"""Batch-size ramp-up (training.global_batch_schedule): which global batch each step trains on,
checked against the layout before launch, and the lr factor that follows it
(training.batch_lr_scaling).

A step's batch continues the global data stream where the last one stopped, whatever their
sizes: the stream is cut into steps of these sizes exactly as a run that used them from its
start would cut it (titan.components.data.dataloader: IndexedLoader.resize).
"""

from dataclasses import dataclass

from titan.config import ConfigError

_EXPONENT = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


@dataclass(frozen=True)
class BatchSchedule:
    base: int  # training.global_batch_size (resolved): before the first entry, and the lr's
    entries: tuple[tuple[int, int], ...] = ()  # (first step, global batch size), by step
    lr_scaling: str = "none"

    def size_at(self, step: int) -> int:
        """The global batch size of (1-based) step `step`."""
        size = self.base
        for first, s in self.entries:
            if step >= first:
                size = s
        return size

    def lr_factor(self, step: int) -> float:
        return (self.size_at(step) / self.base) ** _EXPONENT[self.lr_scaling]

    def sizes(self) -> list[int]:
        return sorted({self.base, *(s for _, s in self.entries)})


def step_entries(key: str, texts, what: str, example: str) -> list[tuple[int, int]]:
    """The (step, value) pairs of a schedule option `key` ("step:value" strings, `what` naming
    the value, e.g. size), steps from 1 and increasing; ConfigError naming the entry
    otherwise. The values' own rules are the caller's."""
    entries, last = [], 0
    for text in texts:
        step, sep, value = str(text).partition(":")
        try:
            pair = (int(step), int(value))
        except ValueError:
            pair = None
        if not sep or pair is None:
            raise ConfigError(f"{key}: {text!r} is not 'step:{what}' (e.g. {example})")
        if pair[0] < 1 or pair[0] <= last:
            raise ConfigError(f"{key}: {text!r}: steps start at 1 and increase from entry to entry")
        last = pair[0]
        entries.append(pair)
    return entries


def parse_schedule(job, base: int, per_step: int) -> BatchSchedule:
    """training.global_batch_schedule of `job`, each size a multiple of `per_step` (the
    sequences one accumulation step takes over the data-parallel ranks); ConfigError naming
    the entry and the fix otherwise."""
    t = job.training
    key = "training.global_batch_schedule"
    entries = step_entries(key, t.global_batch_schedule, "size", "1:64,500:128")
    for step, size in entries:
        if size < 1 or size % per_step:
            raise ConfigError(
                f"{key}: '{step}:{size}': a global batch of {size} "
                f"sequences is not a multiple of {per_step} (training.local_batch_size x the "
                "data-parallel degree, one accumulation step); use a multiple of it, or a "
                "smaller local_batch_size"
            )
    return BatchSchedule(base, tuple(entries), t.batch_lr_scaling)
