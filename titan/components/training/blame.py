"""Which document of a flagged step is to blame, once its replay gave the same figures (the
data, not a device): the step is replayed with the labels of half of its documents kept (the
rest IGNORE_INDEX), then of the other half, and the half whose figures score higher against the
spike window is halved again, down to one document: 2 x log2(documents) replays. A kept half's
loss stays a sum over the step's counted tokens, so its gradient is that half's share of the
step's: a document that alone makes the spike keeps making it. Scored by the flagged figures:
the gradient norm as it is, the loss per kept token."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan.components.data.batch import LABELS
from titan.components.data.document_index import DocSpan
from titan.components.training.loss import IGNORE_INDEX


@dataclass(frozen=True)
class Blame:
    documents: list[DocSpan]  # the culprit's spans (one document), or every span of the step
    alone: bool  # the culprit's figures alone score as a spike
    replays: int


def keep_labels(spans: list[DocSpan], first_sample: int, local_batch: int) -> Callable:
    """An edit of this rank's microbatches (its samples from global position `first_sample`
    on, `local_batch` a microbatch) keeping only the labels of `spans`."""

    def edit(microbatches: list[dict]) -> list[dict]:
        out = []
        for m, batch in enumerate(microbatches):
            labels = batch[LABELS]
            keep = torch.zeros_like(labels, dtype=torch.bool)
            for s in spans:
                row = s.sample - first_sample - m * local_batch
                if 0 <= row < labels.shape[0]:
                    keep[row, s.first : s.end] = True
            out.append({**batch, LABELS: torch.where(keep, labels, IGNORE_INDEX)})
        return out

    return edit


def bisect(spans: list[DocSpan], replay: Callable, score: Callable, sigma: float) -> Blame:
    """`replay(kept spans) -> (loss, grad_norm)`; `score(loss per kept token, grad_norm)`:
    how far above the window that is, in deviations."""
    total = sum(s.end - s.first for s in spans)
    docs: dict[tuple, list[DocSpan]] = {}
    for s in spans:
        docs.setdefault((s.dataset, s.document), []).append(s)
    keys, best, replays = list(docs), None, 0
    while len(keys) > 1:
        halves = keys[: len(keys) // 2], keys[len(keys) // 2 :]
        scored = []
        for half in halves:
            kept = [s for k in half for s in docs[k]]
            tokens = sum(s.end - s.first for s in kept)
            loss, norm = replay(kept)
            replays += 1
            scored.append(score(loss * total / max(tokens, 1), norm))
        pick = 0 if scored[0] >= scored[1] else 1
        keys, best = halves[pick], scored[pick]
    if best is None:  # one document: the step's own figures are its
        return Blame(docs[keys[0]], True, replays)
    return Blame(docs[keys[0]], best > sigma, replays)
