"""The [eval] section: lm-evaluation-harness tasks run on the training model every `freq` steps
and after the last; torch-free (the callback is titan.components.evaluation.in_loop)."""

import importlib.util
from dataclasses import dataclass

from titan.components.training.callbacks import CallbackSpec
from titan.config import extensions
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Eval:
    tasks: list[str] = opt(
        [],
        "lm-eval task names run during training (titan's offline kjv_* tasks, lm-eval's, or "
        "eval.include_path's); empty: off",
    )
    include_path: str = opt("", "A folder of more lm-eval task YAMLs")
    freq: int = opt(500, "Evaluate every N steps (and after the last step)")
    num_fewshot: int | None = opt(None, "Examples in each prompt (None: each task's own)")
    limit: float | None = opt(
        None, "At most this many documents a task (< 1: that share); None: all"
    )
    batch_size: int = opt(8, "Requests scored at once on each data-parallel rank")
    max_length: int = opt(0, "Tokens a request sees at most; 0: training.seq_len")
    use_ema: bool = opt(False, "Evaluate the average of the weights ([ema]) instead of them")


def check(job) -> None:
    from titan.config.manager import require_all

    e = job.eval
    if not e.tasks:
        return
    require_all(
        job,
        (
            (e.freq >= 1, "eval.freq", "must be >= 1"),
            (e.batch_size >= 1, "eval.batch_size", "must be >= 1"),
            (e.max_length >= 0, "eval.max_length", "must be >= 0 (0: training.seq_len)"),
            (e.limit is None or e.limit > 0, "eval.limit", "must be > 0 (or None: all)"),
            (
                importlib.util.find_spec("lm_eval") is not None,
                "eval.tasks",
                "needs lm-eval: pip install -e '.[eval]'",
            ),
        ),
    )


def check_tasks(job, plan=None) -> None:
    """Each of eval.tasks is a task lm-eval finds (before any rank starts: the lookup reads
    every task's YAML, a second or two)."""
    if not job.eval.tasks:
        return
    from titan.components.evaluation.tasks import task_manager
    from titan.config import ConfigError

    try:
        task_manager(list(job.eval.tasks), job.eval.include_path)
    except ValueError as e:
        raise ConfigError(f"eval.tasks: {e}") from None


def _ignored(job) -> dict:
    off = not job.eval.tasks
    return extensions.ignored_when(job, "eval", off, "eval.tasks is empty", switch="tasks")


register(
    CallbackSpec(
        "eval",
        build="titan.components.evaluation.in_loop:build_callback",
        check=check,
        section="eval",
        options=Eval,
        plan_check=check_tasks,
        ignored=_ignored,
    )
)
