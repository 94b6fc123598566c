"""Ctrl-C (SIGINT) and SIGTERM: stop at once, say so in a line, exit 128 + the signal.

Checkpoints need no care: a save is marked complete only once every file is written, so one
cut short is an incomplete folder that a resume skips, and the newest complete one is what
the next run loads (titan.components.checkpoint.folders). `status` says which that is.
"""

import signal

STOPPING = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None
_step_source = None  # the trainer's step, read when the signal arrives
_step_at_signal = 0


class Interrupted(BaseException):
    """Raised in the main thread by the first SIGINT/SIGTERM: a BaseException, so no
    `except Exception` on the way out swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install() -> None:
    for signum in STOPPING:
        signal.signal(signum, _stop)


def track(step_source) -> None:
    """Have a stop report the step it arrived in: the step is read by the handler itself,
    since the exception it raises may land in cleanup code (a failed save's, a closing
    trainer's) that would otherwise lose it."""
    global _step_source
    _step_source = step_source


def _stop(signum, frame) -> None:
    global _received, _step_at_signal
    if _received is None:  # later signals while stopping change nothing
        _received = signum
        _step_at_signal = _step_source() if _step_source is not None else 0
        raise Interrupted(signum)


def step_at_signal() -> int:
    """The training step the stopping signal arrived in; 0 before the first step."""
    return _step_at_signal


def received() -> int | None:
    """The stopping signal this process got, if any (a collective that fails because a
    stopping peer left is part of the stop, not an error of its own)."""
    return _received


def status(checkpoint_cfg, dump_folder: str) -> str:
    """Where the next run starts, for the line that reports a stop."""
    from titan.components.checkpoint.folders import COMPLETE_MARKER, folder_problem, step_folders
    from titan.components.checkpoint.storage import checkpoint_root

    if not checkpoint_cfg.enable:
        return "checkpointing is off (checkpoint.enable): the next run starts from step 0"
    root = checkpoint_root(dump_folder, checkpoint_cfg.folder)
    done = [
        p
        for _, p in (step_folders(root) if root.is_dir() else [])
        if (p / COMPLETE_MARKER).is_file() and folder_problem(p, "off") is None
    ]
    if not done:
        return f"no checkpoint was completed in {root}: the next run starts from step 0"
    return (
        f"checkpoints in {root} are intact, the newest complete one is {done[-1].name} "
        "(a save cut short stays incomplete and is skipped): the next run resumes from it"
    )
