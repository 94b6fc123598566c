"""The train-spec registry: what the trainer needs to know about a model family.

A new family registers a TrainSpec; the trainer looks it up by `model.name` and never
imports model code directly.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    # (model, parallel_dims, job_config) -> model, applied TP -> CP -> AC -> compile -> FSDP
    parallelize_fn: Callable
    # (meta-device model, stage id, PipelinePlan) -> the module of that pipeline stage
    pipelining_fn: Callable | None = None
    # maps this family's state dict to and from the HF layout
    state_dict_adapter: type | None = None
    extra: dict = field(default_factory=dict)


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"a train spec named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    import titan.models  # noqa: F401  registers the built-in families

    if name not in _REGISTRY:
        raise KeyError(f"unknown model.name {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_names() -> list[str]:
    import titan.models  # noqa: F401

    return sorted(_REGISTRY)
