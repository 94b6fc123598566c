"""Callbacks: the parts of a run that react to training rather than make it (scheduled garbage
collection, per-rank step times and stragglers, the metrics writers, validation, profiler
traces, memory snapshots, a plugin's monitor), told of the trainer's events.

A callback overrides what it needs of `Callback`. Every rank builds the same callbacks and
gets every event in the same order (registration order, titan's own first), with figures that
are the same on every rank (the global loss and gradient norm), so a callback may use
collectives in its events (not in `on_stop`, which a failing rank reaches alone) and its
requests (`run.request_stop`, `run.request_save`) are made alike on every rank. Its
`state_dict()` (tensors) is saved in every training checkpoint and given back on resume, so a
resumed run's callbacks continue exactly.

A callback is registered with its spec: `register(CallbackSpec("name", build=
"module:function", section=..., options=...))`, titan's own in BUILTIN below, a plugin's
through --job.custom_import. `function(run, options)` returns the callback, or None where
this run does not use it (its section off). Torch-free: specs are read before torch loads.
"""

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from titan.config import extensions
from titan.config.entry import Entry, register

logger = logging.getLogger("titan")


class StopTraining(RuntimeError):
    """A callback's verdict that the run must end at this step, its update not taken: the
    run stops with this message (exit 1; a restart would meet the same step again)."""


@dataclass(frozen=True)
class StepEnd:
    """A training step's figures, the same on every rank. `loss` and `grad_norm` stay on the
    device until a callback reads them (the host then waits for the step to finish: read
    them at logged steps, `logged is not None`, where it waits anyway)."""

    step: int
    # the step's global figures (titan.components.training.step_figures.StepFigures)
    figures: Any
    lr: float
    skipped: bool  # the optimizer did not step (non-finite figures, torchft's quorum, a
    #                callback's judge_step)
    tokens_seen: int  # training tokens of all ranks so far
    logged: dict | None  # the metrics record, when this step was logged

    @property
    def loss(self) -> float:
        """The global batch's loss."""
        return self.figures.loss

    @property
    def grad_norm(self) -> float:
        """Over every parameter of every rank."""
        return self.figures.grad_norm


class Callback:
    """The trainer's events; `run` is the trainer's view (titan.trainer.run_view.RunView)."""

    # whether it calls run.replay_step: only then does every step keep a copy of its inputs
    replays: bool = False

    def on_train_start(self, run) -> None:
        """Before the first step (after a resume: the step after the checkpoint's)."""

    def around_step(self, run, step: int):
        """A context manager the step runs inside, or None."""
        return None

    def figures(self, run, step: int) -> dict | None:
        """At a step that is logged, before its record is made: figures to add to it (a
        number, or a list of numbers for a histogram), the same on every rank, which every
        rank calls (collectives allowed)."""
        return None

    def judge_step(self, run, step: int, loss: float, grad_norm: float) -> str | None:
        """Before the step's optimizer update, with its global (finite) loss and gradient
        norm, the same on every rank: a reason to skip the update (a short phrase), or None
        to take it. Raise StopTraining to end the run here, the update not taken. Every
        callback is asked, in order; the first reason given is logged. A callback that
        defines it has the host read every step's figures (it waits for the device then)."""
        return None

    def on_step_end(self, run, end: StepEnd) -> None:
        """After the step, its figures logged and before its checkpoint is due."""

    def on_validation_end(self, run, step: int, loss: float, batches: int) -> None:
        """After a validation pass (`batches`: the forwards of each rank)."""

    def on_evaluation_end(self, run, step: int, scores: dict[str, float]) -> None:
        """After a downstream evaluation: its scores by "task/metric" (e.g.
        "hellaswag/acc"), the same on every rank."""

    def around_export(self, run):
        """A context manager the run's final export (a model-only or HF save) is written
        inside, or None: what it enters is what the export holds (an average of the
        weights, say); it must leave the model as it found it."""
        return None

    def around_scoring(self, run, scorer: str):
        """A context manager the model is scored inside by `scorer` ("validation", or "eval":
        a downstream evaluation), or None: what it enters is the model they score (an
        average of the weights, say), and the value it gives names that in their log ("the
        EMA weights"); it must leave the model as it found it."""
        return None

    def on_checkpoint_saved(self, run, step: int, path: str) -> None:
        """A checkpoint of `step` is written, or being written (an async save)."""

    def on_train_end(self, run) -> None:
        """After the last step, or the step a stop was requested at."""

    def on_stop(self, run, error: BaseException) -> None:
        """The run ends with `error` (a failure, or an interrupting signal): on this rank
        only, so no collectives."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly, as tensors ({}: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class CallbackSpec(Entry):
    """A callback; build: "module:function", function(run, options) -> Callback | None."""

    kind: ClassVar[str] = "callback"


_CALLBACKS = extensions.Registry(CallbackSpec.kind)
unregister_callback = _CALLBACKS.remove


def register_callback(spec: CallbackSpec) -> None:
    extensions.said_once("register_callback(spec)", "titan.config.extensions.register(spec)")
    extensions.register(spec)


class Callbacks(dict):
    """A run's callbacks by name, in registration order, and the trainer's ways of telling
    them of its events."""

    def emit(self, run, event: str, *args) -> None:
        """Call `event` of every callback, in order."""
        for callback in self.values():
            getattr(callback, event)(run, *args)

    def figures(self, run, step: int) -> dict:
        """What each callback measured of a logged step, merged."""
        out = {}
        for callback in self.values():
            out.update(callback.figures(run, step) or {})
        return out

    def around_step(self, run, step: int) -> contextlib.ExitStack:
        return self._entered(lambda cb: cb.around_step(run, step))

    def around_export(self, run, export: bool) -> contextlib.ExitStack:
        """The contexts an export is written in (none where `export` is False)."""
        return self._entered(lambda cb: cb.around_export(run) if export else None)

    @contextlib.contextmanager
    def around_scoring(self, run, scorer: str):
        """The contexts `scorer` scores the model in; gives the names of what they put in the
        model (empty: the trained weights)."""
        given: list = []
        with self._entered(lambda cb: cb.around_scoring(run, scorer), given):
            yield [name for name in given if name]

    def _entered(self, context_of, given: list | None = None) -> contextlib.ExitStack:
        """Every callback's context (where it has one) entered, in order; what each gives on
        entering is appended to `given`."""
        stack = contextlib.ExitStack()
        for callback in self.values():
            context = context_of(callback)
            if context is not None:
                value = stack.enter_context(context)
                if given is not None:
                    given.append(value)
        return stack

    @property
    def judges(self) -> list[Callback]:
        """The callbacks that judge each step's update (the host reads its figures for them)."""
        own = Callback.judge_step
        return [cb for cb in self.values() if type(cb).judge_step is not own]

    @property
    def replay(self) -> bool:
        """Whether one replays steps (each step then keeps its inputs)."""
        return any(cb.replays for cb in self.values())

    def stopping(self, run, error: BaseException) -> None:
        """The run ends with `error` (on this rank only): each callback's on_stop."""
        for callback in self.values():
            try:
                callback.on_stop(run, error)
            except Exception:  # noqa: BLE001  the run's own error is the one to report
                logger.exception("callback %s failed in on_stop", type(callback).__name__)

    def close(self) -> None:
        for callback in self.values():
            callback.close()


def build_callbacks(run, sections: dict) -> Callbacks:
    """This run's callbacks by name, in registration order (titan's own first); a callback
    whose method the trainer cannot call as `Callback` declares it is refused (ConfigError)
    before any step."""
    made = {
        spec.name: extensions.load(spec.build)(run, spec.options_in(sections))
        for spec in _CALLBACKS.entries.values()
    }
    callbacks = Callbacks({name: cb for name, cb in made.items() if cb is not None})
    for name, callback in callbacks.items():
        problem = signature_problem(callback)
        if problem:
            from titan.config.manager import ConfigError

            raise ConfigError(f"callback {name!r}: {problem}; see docs/extending.md, Callbacks")
    return callbacks


def signature_problem(callback: Callback) -> str | None:
    """Why the trainer cannot call one of `callback`'s methods as Callback declares it (the
    arguments it passes, by position), or None."""
    for method, declared in vars(Callback).items():
        mine = getattr(type(callback), method, None)
        if method.startswith("_") or not inspect.isfunction(declared) or mine is declared:
            continue
        passed = len(inspect.signature(declared).parameters)  # self included
        params = list(inspect.signature(mine).parameters.values())
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            continue
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        if len(required) > passed or len(positional) < passed:
            want = ", ".join(inspect.signature(declared).parameters)
            got = ", ".join(p.name for p in params)
            return (
                f"{type(callback).__name__}.{method}({got}) cannot take what the trainer passes: "
                f"{method}({want})"
            )
    return None


_OWN = "titan.components"
# the figures' callbacks first: the metrics writers then see a validation's figures, and every
# later callback the step's whole record; validation's and profiling's own are registered with
# their sections (training/validation_spec.py, observability/profiling_spec.py), after these
register(
    CallbackSpec("memory_measured", build=f"{_OWN}.observability.memory_measure:build_callback")
)
register(CallbackSpec("gc", build=f"{_OWN}.training.gc:build_callback"))
register(CallbackSpec("rank_times", build=f"{_OWN}.observability.rank_times:build_callback"))
register(CallbackSpec("metrics_writers", build=f"{_OWN}.observability.writers:build_callback"))
