"""Model converters: rewrites of the whole meta model before any parallelism (float8's linear
layers, the chunked loss's output layer, LoRA's adapters, a plugin's), and what each changes
around the run: which parameters train, what a training checkpoint holds and records, what a
final export adds, what runs after each optimizer step.

One registry (on titan.config.extensions, as optimizers, writers and callbacks): an entry names
its builder by module path, so this module and the entries' specs stay torch-free and a config
is checked before torch is imported. The run assembles the enabled converters in one place,
`Converters` (titan.assembly.build); nothing else names one.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from titan.config import extensions
from titan.config.entry import Entry


@dataclass(frozen=True)
class ConverterSpec(Entry):
    """A model converter; build: "module:function", function(job) -> Converter. Its checks
    run when it is enabled."""

    kind: ClassVar[str] = "converter"
    # enabled(job): whether a run uses it by its own switch (lora.rank); model.converters
    # naming it always enables it
    enabled: Callable[[Any], bool] | None = None
    # where it applies among the enabled ones, lowest first (titan's: float8 10, the chunked
    # loss 20, LoRA 30); ties in registration order. Fixed here, not by import order
    order: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.plan_check is not None and _takes_four(self.plan_check):
            # the spelling of earlier docs: plan_check(job, train_spec, model_args, device)
            old = self.plan_check
            extensions.said_once(
                "ConverterSpec.plan_check(job, train_spec, model_args, device)",
                "plan_check(job, plan) (plan.spec, plan.model_args, plan.device)",
                stacklevel=4,  # past __post_init__ and the dataclass's __init__: the plugin's line
            )
            object.__setattr__(
                self,
                "plan_check",
                lambda job, plan: old(job, plan.spec, plan.model_args, plan.device),
            )

    def unused(self, job) -> str | None:
        return None if _is_enabled(self, job) else f"the {self.name} converter is off"


def _takes_four(fn: Callable) -> bool:
    import inspect

    try:
        return len(inspect.signature(fn).parameters) == 4
    except (TypeError, ValueError):
        return False


class Converter:
    """A converter: `convert` rewrites the meta model in place; the rest say what that changes
    around the run, each defaulting to nothing."""

    # its modules add parameters that a checkpoint holds (LoRA's adapters): a checkpoint's
    # model is the family's converted by it
    adds_parameters = False

    def convert(self, model) -> None:
        raise NotImplementedError

    def init_weights(self, part, seed: int) -> None:
        """After the family's init, on each materialized part: what convert() added."""

    def describe(self, parts, pipelined: bool) -> None:
        """Log what changed (once the parts are built)."""

    def lr_scale(self, name: str, param) -> float:
        """The factor on the lr a trainable parameter (by its clean name) trains with, its
        param group's or optimizer.lr (muP's width scaling); asked after convert()."""
        return 1.0

    def post_optimizer_hook(self, parts) -> Callable[[bool], dict | None] | None:
        """Run after every step, told whether the optimizer stepped (float8's scales)."""
        return None

    def trained(self) -> Callable[[str], bool] | None:
        """The parameters training changes, by name, when a training checkpoint holds only
        them (the rest is the base the run started from); None: it holds the whole model."""
        return None

    def merge(self, state: dict, parts) -> dict:
        """The plain model's state from the whole converted state, for exports."""
        return state

    def fold(self, state: dict, parts) -> dict:
        """The state with what this converter multiplies at run time (muP's multipliers)
        folded into the weights, so that the plain model computes the same: what an export
        (a final model-only or HF save) holds."""
        return state

    def identity(self) -> dict:
        """Settings a training checkpoint records; a resume must have the same ones."""
        return {}

    def exporter(self, parts, train_spec, model_args) -> Callable | None:
        """What a final HF export also runs on its folder (LoRA's PEFT adapter)."""
        return None

    def parametrization(self) -> dict:
        """Settings that change what the trained weights compute (muP's multipliers): every
        save records them, and a resume must have the same."""
        return {}


_CONVERTERS = extensions.Registry(ConverterSpec.kind)
unregister_converter = _CONVERTERS.remove


def register_converter(spec: ConverterSpec) -> None:
    extensions.said_once("register_converter(spec)", "titan.config.extensions.register(spec)")
    extensions.register(spec)


def _is_enabled(spec: ConverterSpec, job) -> bool:
    return spec.name in job.model.converters or bool(spec.enabled and spec.enabled(job))


def enabled_specs(job) -> list[ConverterSpec]:
    """The converters a job uses, in the order they apply."""
    on = [s for s in _CONVERTERS.entries.values() if _is_enabled(s, job)]
    return sorted(on, key=lambda s: s.order)  # stable: ties keep registration order


def names() -> list[str]:
    return list(_CONVERTERS.entries)


def check_names(job) -> None:
    from titan.config.manager import require

    unknown = [c for c in job.model.converters if c not in _CONVERTERS.entries]
    require(job, not unknown, "model.converters", f"unknown {unknown}; titan has {names()}")


def check_together(job, plan) -> None:
    """The enabled converters built together, after each one's own plan check, so a conflict
    stops the launch, not the ranks."""
    Converters(job)


class Converters:
    """The enabled converters of a run, applied and asked together."""

    def __init__(self, job):
        from titan.config import ConfigError

        self.items: list[Converter] = [
            extensions.load(spec.build)(job) for spec in enabled_specs(job)
        ]
        partial = [c for c in self.items if c.trained() is not None]
        if len(partial) > 1:
            raise ConfigError(
                "model converters "
                + ", ".join(type(c).__name__ for c in partial)
                + " each keep only their own parameters in checkpoints; enable one of them"
            )
        self.partial: Converter | None = partial[0] if partial else None

    def convert(self, model) -> None:
        for c in self.items:
            c.convert(model)

    def saved(self, model):
        """`model` converted by those that add parameters: the model a checkpoint holds."""
        for c in self.items:
            if c.adds_parameters:
                c.convert(model)
        return model

    def init_weights(self, part, seed: int) -> None:
        for c in self.items:
            c.init_weights(part, seed)

    def describe(self, parts, pipelined: bool) -> None:
        for c in self.items:
            c.describe(parts, pipelined)

    def lr_scale(self, name: str, param) -> float:
        scale = 1.0
        for c in self.items:
            scale *= c.lr_scale(name, param)
        return scale

    def post_optimizer_hooks(self, parts) -> list:
        return [h for h in (c.post_optimizer_hook(parts) for c in self.items) if h]

    def model_state(self, parts):
        from titan.components.checkpoint.train_state import ModelState

        folding = [c for c in self.items if type(c).fold is not Converter.fold]

        def fold(sd: dict) -> dict:
            for c in folding:
                sd = c.fold(sd, parts)
            return sd

        fold_ = fold if folding else None
        if self.partial is None:
            return ModelState(parts, fold=fold_)
        merge = self.partial.merge
        return ModelState(
            parts, trained=self.partial.trained(), merge=lambda sd: merge(sd, parts), fold=fold_
        )

    def identity(self) -> dict:
        """What the partial converter records (empty without one)."""
        return self.partial.identity() if self.partial else {}

    def parametrization(self) -> dict:
        out = {}
        for c in self.items:
            out.update(c.parametrization())
        return out

    def exporter(self, parts, train_spec, model_args) -> Callable | None:
        made = [e for e in (c.exporter(parts, train_spec, model_args) for c in self.items) if e]
        if not made:
            return None

        def export(folder) -> None:
            for e in made:
                e(folder)

        return export
