"""The metrics writer registry: where each logged step goes besides the console.

A writer is an object with `scalars(step, values)` (values: {"train/loss": ..., ...}, a value
may be None where a figure is unknown, e.g. MFU without a peak), `distribution(step, name,
values)` (numbers indexed by position, e.g. an MoE layer's expert loads) and `close()`.
metrics.jsonl, TensorBoard and W&B are writers; a new backend is one module with its writer
and one `register_writer` call (a plugin's through --job.custom_import). Only rank 0 writes.
Torch-free: a writer's builder is named by module path and imported when a run starts.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from titan.config import extensions


class MetricsWriter(Protocol):
    def scalars(self, step: int, values: dict[str, float | None]) -> None: ...

    def distribution(self, step: int, name: str, values: list[float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WriterContext:
    dump_folder: str
    resume_step: int | None  # the checkpoint step a resumed run continues from
    run_config: dict  # the merged job config, as a nested dict


@dataclass(frozen=True)
class WriterSpec:
    name: str
    # "module:function"; function(metrics_cfg, options, context) -> MetricsWriter
    build: str
    # enabled(metrics_cfg, options) -> whether this run writes to it
    enabled: Callable[..., bool]
    check: Callable | None = None  # check(job_config) raises ConfigError
    section: str | None = None  # its own config section, if any
    options: type | None = None


_WRITERS = extensions.Registry("metrics writer")
register_writer = _WRITERS.add
unregister_writer = _WRITERS.remove
_options = _WRITERS.options_of


def enabled_writers(cfg, sections: dict) -> list[WriterSpec]:
    return [s for s in _WRITERS.entries.values() if s.enabled(cfg, _options(s, sections))]


def build_writers(cfg, sections: dict, context: WriterContext) -> list[MetricsWriter]:
    """The writers this run enables, in registration order (titan's own first)."""
    return [
        extensions.load(spec.build)(cfg, _options(spec, sections), context)
        for spec in enabled_writers(cfg, sections)
    ]


def _check(job) -> None:
    _WRITERS.check(job, enabled_writers(job.metrics, job.extensions))


def _check_wandb(job) -> None:
    # looked up, not imported: the config is checked before any heavy import
    if importlib.util.find_spec("wandb") is None:
        from titan.components.observability.wandb_writer import MISSING
        from titan.config import ConfigError

        raise ConfigError(MISSING)


_OWN = "titan.components.observability"
register_writer(
    WriterSpec("jsonl", build=f"{_OWN}.jsonl_writer:JsonlWriter", enabled=lambda cfg, options: True)
)
register_writer(
    WriterSpec(
        "tensorboard",
        build=f"{_OWN}.tensorboard_writer:TensorBoardWriter",
        enabled=lambda cfg, options: cfg.enable_tensorboard,
    )
)
register_writer(
    WriterSpec(
        "wandb",
        build=f"{_OWN}.wandb_writer:WandbWriter",
        enabled=lambda cfg, options: cfg.enable_wandb,
        check=_check_wandb,
    )
)
extensions.register_check(_check)
