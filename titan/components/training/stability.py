"""Loss and gradient-norm spikes ([stability]): each step's global figures scored against the
mean and standard deviation of the last `spike_window` steps (spikes included, as OLMo-core
keeps them, so a lasting change of level stops counting as one within a window); a figure
more than `spike_sigma` deviations above the mean flags the step, which is logged (with its
scores), written to `<dump_folder>/spikes.jsonl`, counted (`spikes` in the metrics) and, per
`on_spike`, left to update, skipped (the trainer's judge_step seam: no optimizer step), or
stopped at. The figures are the reduced ones every rank holds, so every rank (and every layout
of the same run) decides alike; the window is in checkpoints, so a resumed run decides as the
run it continues would have."""

import json
import logging
import math
import os
import time
from collections import deque

import torch

from titan.components.observability.jsonl_writer import start_history
from titan.components.training.blame import bisect, keep_labels
from titan.components.training.callbacks import Callback, StopTraining

logger = logging.getLogger("titan")

# beside spikes.jsonl: the documents replays blamed alone, as training.skip_documents reads them
SUGGESTED = "suggested_skip_documents.jsonl"


def spike_score(value: float, window) -> float:
    """How many standard deviations (sample form, n - 1) of the window's values `value` lies
    above their mean; inf for a value above a window without spread."""
    n = len(window)
    mean = math.fsum(window) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in window) / (n - 1))
    if std > 0:
        return (value - mean) / std
    return math.inf if value > mean else 0.0


class SpikeMonitor(Callback):
    def __init__(self, cfg, dump_folder: str, rank: int):
        self.cfg, self.rank = cfg, rank
        self.path = os.path.join(dump_folder, "spikes.jsonl")
        self.windows = {m: deque(maxlen=cfg.spike_window) for m in cfg.spike_metrics}
        self.spikes = 0  # flagged steps so far
        self.replays = cfg.rerun_on_spike

    def on_train_start(self, run) -> None:
        if self.rank == 0:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            branched = run.history_set_aside is not None
            start_history(self.path, run.step if run.step > 0 else None, branched)

    def judge_step(self, run, step: int, loss: float, grad_norm: float) -> str | None:
        values = {"loss": loss, "grad_norm": grad_norm}
        full = all(len(w) == w.maxlen for w in self.windows.values())
        scores = {m: spike_score(values[m], w) for m, w in self.windows.items()} if full else {}
        flagged = [m for m, score in scores.items() if score > self.cfg.spike_sigma]
        what = self._describe(values, scores, flagged) if flagged else ""
        before = {m: list(w) for m, w in self.windows.items()}
        for m, w in self.windows.items():
            w.append(values[m])
        if not flagged:
            return None
        self.spikes += 1
        rerun = None
        if self.cfg.rerun_on_spike:
            started = time.perf_counter()
            rerun = self._rerun(run, values, before, flagged)
            run.exclude_time(time.perf_counter() - started)  # the step's tokens/s as without
        if rerun is not None:
            what += f"; {rerun['says']}"
        self._record(step, values, scores, flagged, rerun)
        if self.cfg.on_spike == "stop":
            ranks = (rerun or {}).get("ranks")
            then = (
                f"restart the job from the last checkpoint without the node(s) of rank(s) {ranks}"
                if ranks
                else "resume from the last checkpoint (with stability.on_spike = skip to step "
                "over it, or a lower optimizer.lr)"
            )
            raise StopTraining(
                f"step {step}: {what}; stopped before its update (stability.on_spike = stop). "
                f"The spike is in {self.path}; {then}"
            )
        if self.cfg.on_spike == "log":
            logger.warning(
                "step %d: %s; the update is taken (stability.on_spike = log)", step, what
            )
            return None
        return f"{what} (stability.on_spike = skip)"

    def _rerun(self, run, values: dict, window: dict, flagged: list[str]) -> dict:
        """Replay the step: the same figures (bitwise) blame the data, and replays of parts
        of it the document; different ones the ranks whose local gradient norms changed."""
        replay = run.replay_step()
        again = {"loss": replay.loss, "grad_norm": replay.grad_norm}
        tol = self.cfg.rerun_rtol
        if all(abs(again[k] - values[k]) <= tol * abs(values[k]) for k in again):
            found = self._blame(run, window, flagged)
            same = "bitwise" if tol == 0 else f"within {tol:g}"
            says = f"its replay gives the same loss and grad norm {same}: the data; " + found.pop(
                "says"
            )
            return {
                "verdict": "data",
                "says": says,
                **{f"rerun_{k}": v for k, v in again.items()},
                **found,
            }
        ranks = replay.differing_ranks()
        norms = "; ".join(
            f"rank {r}: {replay.rank_norms[r][0]:.4g}, replayed {replay.rank_norms[r][1]:.4g}"
            for r in ranks
        )
        says = (
            f"its replay gives loss {replay.loss:.6g}, grad norm {replay.grad_norm:.4g}: a "
            "device, not the data"
            + (f", on rank(s) {ranks} (local grad norm {norms})" if ranks else "")
        )
        return {
            "verdict": "compute",
            "says": says,
            "ranks": ranks,
            **{f"rerun_{k}": v for k, v in again.items()},
            "rank_grad_norms": [list(x) for x in replay.rank_norms],
        }

    def _blame(self, run, window: dict, flagged: list[str]) -> dict:
        spans = run.step_documents()
        if spans is None:
            return {"says": "its documents cannot be named (a streamed or chat source)"}
        plan, t = run.plan, run.job.training
        per_rank = plan.global_batch_size // plan.data_parallel_size
        first = run.data_shard.dp_rank * per_rank

        def replay(kept):
            r = run.replay_step(keep_labels(kept, first, t.local_batch_size))
            return r.loss, r.grad_norm

        def score(loss_per_token: float, grad_norm: float) -> float:
            now = {"loss": loss_per_token, "grad_norm": grad_norm}
            return max(spike_score(now[m], window[m]) for m in flagged)

        found = bisect(spans, replay, score, self.cfg.spike_sigma)
        if self.cfg.on_spike == "log":  # the update is taken: from the whole step's gradients
            run.replay_step()
        named = found.documents if found.alone else spans
        docs = [{**s.entry(), "sample": s.sample, "labels": [s.first, s.end]} for s in named]
        if found.alone:
            s = found.documents[0]
            says = (
                f"document {s.document} of {s.dataset} (sample {s.sample} of the global batch, "
                f"labels {s.first}-{s.end - 1}) makes it alone ({found.replays} replays)"
            )
        else:
            says = (
                f"no one document makes it alone ({found.replays} replays): the step's "
                f"{len({(s.dataset, s.document) for s in spans})} documents are listed"
            )
        return {"says": says, "documents": docs, "alone": found.alone, "replays": found.replays}

    def _describe(self, values: dict, scores: dict, flagged: list[str]) -> str:
        n = self.cfg.spike_window
        parts = []
        for m in self.windows:
            w = self.windows[m]
            mean = math.fsum(w) / len(w)
            parts.append(
                f"{m} {values[m]:.4g} ({scores[m]:+.1f} sigma; the last {n} steps' mean {mean:.4g})"
            )
        return f"{' and '.join(flagged)} spike: " + "; ".join(parts)

    def _record(self, step, values, scores, flagged, rerun: dict | None) -> None:
        if self.rank != 0:
            return
        rerun = {k: v for k, v in (rerun or {}).items() if k != "says"}
        record = {
            "step": step,
            "flagged": flagged,
            **{m: values[m] for m in self.windows},
            # a window without spread scores inf: null in strict JSON
            **{f"{m}_sigma": scores[m] if math.isfinite(scores[m]) else None for m in self.windows},
            "action": self.cfg.on_spike,
            **rerun,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if rerun.get("alone"):
            self._suggest(rerun["documents"])

    def _suggest(self, documents: list[dict]) -> None:
        """Documents a replay blamed alone, each once, in training.skip_documents' form: the
        file a resume that leaves them out names (a step whose documents none makes alone
        suggests nothing: dropping them all would drop what may be noise)."""
        path = os.path.join(os.path.dirname(self.path), SUGGESTED)
        known = set()
        if os.path.exists(path):
            with open(path) as f:
                known = {(e["dataset"], e["document"]) for e in map(json.loads, f) if e}
        new = [d for d in documents if (d["dataset"], d["document"]) not in known]
        with open(path, "a") as f:
            for d in new:
                f.write(json.dumps({"dataset": d["dataset"], "document": d["document"]}) + "\n")
        for d in new:
            logger.warning(
                "document %d of %s added to %s: resume with --training.skip_documents %s to "
                "leave it out",
                d["document"],
                d["dataset"],
                path,
                path,
            )

    def figures(self, run, step: int) -> dict | None:
        return {"spikes": self.spikes} if self.spikes else None

    # the window's length is in its keys: a run resumed with another spike_window finds none
    # of them and starts the window afresh (the trainer logs that) instead of failing the load
    def _key(self, metric: str) -> str:
        return f"{metric}_last{self.cfg.spike_window}"

    def state_dict(self) -> dict:
        state = {"spikes": torch.tensor(self.spikes, dtype=torch.int64)}
        for m, w in self.windows.items():
            slots = torch.full((self.cfg.spike_window,), math.nan, dtype=torch.float64)
            slots[: len(w)] = torch.tensor(list(w), dtype=torch.float64)
            state[self._key(m)] = slots
        return state

    def load_state_dict(self, state: dict) -> None:
        self.spikes = int(state["spikes"])
        for m, w in self.windows.items():
            w.clear()
            w.extend(float(x) for x in state[self._key(m)].tolist() if not math.isnan(x))


def build_callback(run, options) -> SpikeMonitor | None:
    if options.spike_window == 0:
        return None
    return SpikeMonitor(options, run.dump_folder, run.rank)
