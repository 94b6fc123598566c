"""Sequence-length warm-up (training.seq_len_schedule): the length each step trains at, and
each step's shape (`StepShape`) from it and the batch-size schedule (titan.plan.batch_schedule).

The data stream is always cut into windows of training.seq_len, the longest length. A window
of length l = seq_len / n is one of the n consecutive pieces of such a window (its tokens
j x l .. (j + 1) x l, the next token as the last label), so a step at length l trains on the
labels a run without the schedule trains on at that place of the stream, each seeing its
piece's context only. With `keeps = "tokens"` a step takes as many seq_len windows as its global
batch size, as n times the sequences (each microbatch n times the rows); with "sequences" it
takes global batch size / n of them, as the global batch size's sequences.
"""

from dataclasses import dataclass

from titan.config import ConfigError
from titan.plan.batch_schedule import step_entries


@dataclass(frozen=True)
class StepShape:
    """What one step trains on."""

    seq_len: int  # tokens per sequence
    sequences: int  # sequences over all data-parallel ranks
    local_batch: int  # sequences per microbatch on a data-parallel rank
    grad_accum: int  # microbatches per data-parallel rank
    windows: int  # training.seq_len windows taken from the data stream
    pieces: int  # training.seq_len / seq_len


@dataclass(frozen=True)
class SeqLenSchedule:
    longest: int  # training.seq_len: before the first entry, and every window's length
    entries: tuple[tuple[int, int], ...] = ()  # (first step, length), by step
    keeps: str = "tokens"

    def length_at(self, step: int) -> int:
        """The sequence length of (1-based) step `step`."""
        length = self.longest
        for first, n in self.entries:
            if step >= first:
                length = n
        return length

    def shape(self, windows: int, local_batch: int, grad_accum: int, step: int) -> StepShape:
        """The shape of step `step`, whose global batch size is `windows` (sequences of
        training.seq_len) in microbatches of `local_batch`, `grad_accum` a rank."""
        length = self.length_at(step)
        n = self.longest // length
        if self.keeps == "tokens":
            return StepShape(length, windows * n, local_batch * n, grad_accum, windows, n)
        return StepShape(length, windows, local_batch, grad_accum, windows // n, n)


def parse_seq_len_schedule(job) -> SeqLenSchedule:
    """training.seq_len_schedule of `job`, each length a divisor of training.seq_len;
    ConfigError naming the entry and the fix otherwise (what a layout and the batch sizes
    need of each length: titan.plan.run_plan.check_seq_len_schedule)."""
    t = job.training
    key = "training.seq_len_schedule"
    entries = step_entries(key, t.seq_len_schedule, "length", "1:512,1000:2048")
    for step, length in entries:
        if length < 1 or length > t.seq_len or t.seq_len % length:
            raise ConfigError(
                f"{key}: '{step}:{length}': a length of {length} does not divide "
                f"training.seq_len = {t.seq_len} (the longest length: windows of a shorter one "
                "are its pieces); use a divisor of it, or raise training.seq_len"
            )
    return SeqLenSchedule(t.seq_len, tuple(entries), t.seq_len_schedule_keeps)


def change_steps(*schedules) -> list[int]:
    """The steps at which any of the schedules (None: absent) changes, and step 1."""
    return sorted({1, *(s for sch in schedules if sch is not None for s, _ in sch.entries)})
