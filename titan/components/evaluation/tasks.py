"""Where lm-eval finds tasks: titan's offline ones (assets/eval_tasks) and a user's folder."""

from titan.runtime.paths import REPO_ROOT

BUNDLED_TASKS = REPO_ROOT / "assets" / "eval_tasks"


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager over titan's tasks and `include_path`'s; raises ValueError
    naming the tasks it does not know."""
    from lm_eval.tasks import TaskManager

    paths = [str(BUNDLED_TASKS)] + ([include_path] if include_path else [])
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"no lm-eval task named {', '.join(unknown)} (lm-eval's own, titan's in "
            f"{BUNDLED_TASKS}, or the include path's)"
        )
    return manager
