"""The metrics writer registry: where each logged step goes besides the console.

A writer is an object with `scalars(step, values)` (values: {"train/loss": ..., ...}, a value
may be None where a figure is unknown, e.g. MFU without a peak), `distribution(step, name,
values)` (numbers indexed by position, e.g. an MoE layer's expert loads) and `close()`.
metrics.jsonl, TensorBoard and W&B are writers; a new backend is one module with its writer
and one `register_writer` call (a plugin's through --job.custom_import). Only rank 0 writes,
through the `metrics_writers` callback (MetricsWriters), which gets each logged step's record.
Torch-free: a writer's builder is named by module path and imported when a run starts.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from titan.components.training.callbacks import Callback
from titan.config import extensions
from titan.config.entry import Entry, register


class MetricsWriter(Protocol):
    def scalars(self, step: int, values: dict[str, float | None]) -> None: ...

    def distribution(self, step: int, name: str, values: list[float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WriterContext:
    dump_folder: str
    resume_step: int | None  # the checkpoint step a resumed run continues from
    run_config: dict  # the merged job config, as a nested dict
    # the start set another history's checkpoints aside (a run that went back): the
    # histories after resume_step are set aside with them
    branched: bool = False


@dataclass(frozen=True)
class WriterSpec(Entry):
    """A metrics writer; build: "module:function", function(metrics_cfg, options, context) ->
    MetricsWriter."""

    kind: ClassVar[str] = "metrics writer"
    # enabled(metrics_cfg, options) -> whether this run writes to it
    enabled: Callable[..., bool]

    def unused(self, job) -> str | None:
        on = self.enabled(job.metrics, self.options_in(job.extensions))
        return None if on else f"the {self.name} writer is off"


_WRITERS = extensions.Registry(WriterSpec.kind)
unregister_writer = _WRITERS.remove


def register_writer(spec: WriterSpec) -> None:
    extensions.said_once("register_writer(spec)", "titan.config.extensions.register(spec)")
    extensions.register(spec)


def enabled_writers(cfg, sections: dict) -> list[WriterSpec]:
    return [s for s in _WRITERS.entries.values() if s.enabled(cfg, s.options_in(sections))]


def build_writers(cfg, sections: dict, context: WriterContext) -> list[MetricsWriter]:
    """The writers this run enables, in registration order (titan's own first)."""
    return [
        extensions.load(spec.build)(cfg, spec.options_in(sections), context)
        for spec in enabled_writers(cfg, sections)
    ]


class MetricsWriters(Callback):
    """The run's writers, as a callback: each logged step's record (`train/<key>`; a list of
    numbers, an MoE layer's expert loads, is a distribution only) and each validation's
    figures (`validation/<key>`). Only rank 0 writes; they are opened when training starts,
    when a resumed run knows the step its history is kept up to."""

    def __init__(self, cfg, sections: dict, run_config: dict):
        self.cfg, self.sections, self.run_config = cfg, sections, run_config
        self.writers: list[MetricsWriter] = []

    def on_train_start(self, run) -> None:
        import os

        if run.rank != 0:
            return
        os.makedirs(run.dump_folder, exist_ok=True)
        context = WriterContext(
            dump_folder=run.dump_folder,
            resume_step=run.step or None,
            run_config=self.run_config,
            branched=run.history_set_aside is not None,
        )
        self.writers = build_writers(self.cfg, self.sections, context)

    def on_step_end(self, run, end) -> None:
        if end.logged is not None:
            self.write(end.step, end.logged)

    def write(self, step: int, record: dict) -> None:
        lists = {k: v for k, v in record.items() if isinstance(v, list)}
        scalars = {f"train/{k}": v for k, v in record.items() if k != "step" and k not in lists}
        for writer in self.writers:
            writer.scalars(step, scalars)
            for k, v in lists.items():
                writer.distribution(step, f"train/{k}", v)

    def on_validation_end(self, run, step: int, loss: float, batches: int) -> None:
        for writer in self.writers:
            writer.scalars(step, {"validation/loss": loss, "validation/batches": batches})

    def on_evaluation_end(self, run, step: int, scores: dict[str, float]) -> None:
        for writer in self.writers:
            writer.scalars(step, {f"eval/{k}": v for k, v in scores.items()})

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def build_callback(run, options) -> MetricsWriters:
    from titan.config.manager import as_dict

    job = run.job
    return MetricsWriters(job.metrics, job.extensions, as_dict(job))


def _check_wandb(job) -> None:
    # looked up, not imported: the config is checked before any heavy import
    if importlib.util.find_spec("wandb") is None:
        from titan.components.observability.wandb_writer import MISSING
        from titan.config import ConfigError

        raise ConfigError(MISSING)


_OWN = "titan.components.observability"
register(
    WriterSpec("jsonl", build=f"{_OWN}.jsonl_writer:JsonlWriter", enabled=lambda cfg, options: True)
)
register(
    WriterSpec(
        "tensorboard",
        build=f"{_OWN}.tensorboard_writer:TensorBoardWriter",
        enabled=lambda cfg, options: cfg.enable_tensorboard,
    )
)
register(
    WriterSpec(
        "wandb",
        build=f"{_OWN}.wandb_writer:WandbWriter",
        enabled=lambda cfg, options: cfg.enable_wandb,
        check=_check_wandb,
    )
)
