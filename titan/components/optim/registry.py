"""The optimizer registry: what the optimizer builder, the memory planner and the checkpoint
disk check know of an optimizer, each asking the same entry. Torch-free (configs are checked
before torch is imported): an entry names its builder by module path, loaded when a run builds
its optimizer.

An optimizer is added by a module that calls `register_optimizer` (titan's own are imported
by titan/components/optim/builtin.py; a plugin's by --job.custom_import).
"""

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import ClassVar

from titan.config import extensions
from titan.config.entry import Entry
from titan.runtime.names import canonical_name

# names seen by optimizers and param_groups regexes leave the wrappers out, as checkpoints do
clean_name = canonical_name


@dataclass(frozen=True)
class OptimizerSpec(Entry):
    """An optimizer.name. build: "module:function"; function(param_groups, cfg, options) ->
    torch.optim.Optimizer, where each group holds params, param_names, lr and weight_decay, cfg
    is the [optimizer] section and options the entry's own section (None without one)."""

    kind: ClassVar[str] = "optimizer"
    # state_bytes(name, shape, elements, cfg, options): bytes of one parameter's optimizer
    # state when a rank holds `elements` of its `shape`
    state_bytes: Callable[..., int]

    def unused(self, job) -> str | None:
        return (
            None if job.optimizer.name == self.name else f"optimizer.name is {job.optimizer.name}"
        )


_OPTIMIZERS = extensions.Registry(OptimizerSpec.kind)
unregister_optimizer = _OPTIMIZERS.remove


def register_optimizer(spec: OptimizerSpec) -> None:
    extensions.said_once("register_optimizer(spec)", "titan.config.extensions.register(spec)")
    extensions.register(spec)


def optimizer_spec(name: str) -> OptimizerSpec:
    return _OPTIMIZERS.entries[name]


def state_bytes(
    spec: OptimizerSpec, name: str, shape: tuple[int, ...], elements: int, cfg, sections: dict
) -> int:
    return spec.state_bytes(
        clean_name(name), tuple(shape), elements, cfg, spec.options_in(sections)
    )


def save_state_bytes(named_shapes, cfg, sections: dict) -> int:
    """Bytes of the optimizer state of whole (unsharded) parameters, as a checkpoint holds."""
    spec = optimizer_spec(cfg.name)
    return sum(state_bytes(spec, n, s, prod(s), cfg, sections) for n, s in named_shapes)


def check_name(job) -> None:
    """optimizer.name names a registered optimizer (the [optimizer] section's check)."""
    from titan.config.manager import did_you_mean, require

    name, names = job.optimizer.name, list(_OPTIMIZERS.entries)
    require(
        job,
        name in names,
        "optimizer.name",
        f"no such optimizer; registered: {', '.join(names)}{did_you_mean(name, names)}",
    )
