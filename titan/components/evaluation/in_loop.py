"""lm-evaluation-harness tasks on the training model ([eval]), every `eval.freq` steps and after
the last, through the same TitanLM as python -m titan.tools.eval, on the model's parts as
they are (no gathering): data-parallel ranks split the requests (in lockstep, as FSDP's
forwards are collective); tensor-parallel, context-parallel ranks and pipeline stages run theirs
together.

Training is left exactly as it was: the model goes back to train mode, and lm-eval's seeding
(Python's, NumPy's and torch's generators) is undone, so a run with evaluations trains to the
same losses as one without. The time is kept out of tokens/s. The scores, by "task/metric",
go to every writer as eval/<task>/<metric> (eval.jsonl beside validation.jsonl) and the
console.
"""

import contextlib
import io
import logging
import sys
import time

import torch
import torch.distributed as dist

from titan.components.training.callbacks import Callback, StepEnd
from titan.runtime.rng import rng_kept

logger = logging.getLogger("titan")


def scores_of(results: dict) -> dict[str, float]:
    """lm-eval's per-task numbers as "task/metric" (a filter other than none appended)."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            out[f"{task}/{metric}" + ("" if filt == "none" else f"_{filt}")] = float(value)
    return out


class _Advice(logging.Filter):
    """lm-eval's advice for its own command line (`--metadata`), and its notes on metrics
    that titan's bundled tasks define as it means them: not for a training console."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return "`--metadata`" not in text and not (
            "[Task: kjv_" in text and "is defined, but" in text
        )


class _NoProgressBars(io.TextIOBase):
    """stderr without tqdm's bars: line by line, a line holding a carriage return or a bar's
    counters is left out."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self._line(line + "\n")
        return len(text)

    def _line(self, line: str) -> None:
        if not ("\r" in line or "it/s]" in line or "?it/s" in line):
            self.stream.write(line)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if self.pending:
            self._line(self.pending)
        self.flush()


@contextlib.contextmanager
def quiet_lm_eval():
    """Within, lm-eval says only what a training console needs: its warnings and errors
    (its INFO lines, progress bars and console advice left out)."""
    lm_eval, task = logging.getLogger("lm_eval"), logging.getLogger("lm_eval.api.task")
    level, advice = lm_eval.level, _Advice()
    lm_eval.setLevel(logging.WARNING)
    task.addFilter(advice)
    stderr = _NoProgressBars(sys.stderr)
    try:
        with contextlib.redirect_stderr(stderr):
            yield
    finally:
        stderr.close()
        lm_eval.setLevel(level)
        task.removeFilter(advice)


class EvalCallback(Callback):
    def __init__(self, cfg, run):
        from titan.components.evaluation.lm_eval_model import TitanLM
        from titan.components.evaluation.tasks import task_manager

        self.cfg, self.last_step = cfg, run.job.training.steps
        # the names were checked before launch (eval_spec.check_tasks)
        self.manager = task_manager(list(cfg.tasks), cfg.include_path)
        self.lm = TitanLM(
            run.token_scores,
            run.plan.tokenizer,
            max_length=cfg.max_length or run.job.training.seq_len,
            device=run.device,
            batch_size=cfg.batch_size,
            group=run.dp_group,
            lockstep=True,
            decode=run.logits if run.decodes else None,
        )

    def on_step_end(self, run, end: StepEnd) -> None:
        if end.step % self.cfg.freq and end.step != self.last_step:
            return
        from lm_eval import simple_evaluate

        started = time.perf_counter()
        for part in run.model_parts:
            part.eval()
        try:
            with (
                rng_kept(run.device),
                torch.no_grad(),
                run.callbacks.around_scoring(run, "eval"),
                quiet_lm_eval(),
            ):
                results = simple_evaluate(
                    model=self.lm,
                    tasks=list(self.cfg.tasks),
                    num_fewshot=self.cfg.num_fewshot,
                    limit=self.cfg.limit,
                    task_manager=self.manager,
                    log_samples=False,
                )
        finally:
            for part in run.model_parts:
                part.train()
        scores = [scores_of(results) if results is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(scores, src=0)  # lm-eval returns them on rank 0
        seconds = time.perf_counter() - started
        run.exclude_time(seconds)
        line = "  ".join(f"{k}: {v:.4f}" for k, v in scores[0].items())
        logger.info("eval  step: %6d  %s  (%.1fs)", end.step, line, seconds)
        run.notify("on_evaluation_end", end.step, {**scores[0], "seconds": seconds})


def build_callback(run, options) -> EvalCallback | None:
    if not options.tasks:
        return None
    return EvalCallback(options, run)
