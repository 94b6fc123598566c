"""The one kind of entry: everything added to titan (a model family, an optimizer, a metrics
writer, a callback, a model converter, an objective term, a dataset, a plain config section)
is an `Entry`, registered by `register(entry)`, titan's own and a plugin's alike.

An entry carries what every part of titan asks of it: its config section, its checks of the
config alone (`check(job)`, torch-free) and of the planned run (`plan_check(job, plan)`, once
the model, the layout, the tokenizer and the device are known), what it makes a setting
ignored, the weight copies it keeps (for the memory planner and the disk check), and its
builder by module path. A kind (Entry's subclass) adds its own fields and says when a run
uses one of its entries (`unused`): an unused entry's checks are skipped and the settings of
its section typed on the command line are named as ignored.

Torch-free: a config is checked before torch is imported.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import ClassVar

from titan.config.plugins import import_plugin, load

# titan's own registrations, imported on first use the way a plugin's are by
# --job.custom_import: the core sections' entries, the planned run's core checks, then the
# components' and the families' sections
BUILTIN = ("titan.config.core_checks", "titan.plan.checks", "titan.components.builtin")


@dataclass(frozen=True)
class Entry:
    kind: ClassVar[str] = "component"
    # an unused entry's section settings are ignored when typed on the command line (a config
    # file's are a template for runs that use it); False: from the config file too
    typed_only: ClassVar[bool] = True
    name: str
    _: KW_ONLY
    # "module:function" making what the entry adds (its kind says the signature)
    build: str | None = None
    # `[section]` in TOML and `--section.key` on the command line, from `options`, a
    # dataclass of titan.config.job_config.opt fields (their docs are --help's lines)
    section: str | None = None
    options: type | None = None
    # check(job) raises ConfigError (titan.config.manager.require names the key and where its
    # value came from) for settings it cannot take: the config alone, no torch
    check: Callable | str | None = None
    # plan_check(job, plan) raises ConfigError once the run is planned (plan: the RunPlan),
    # so a launch stops before any rank starts; a "module:function" is imported when called
    plan_check: Callable | str | None = None
    # its plan check reads what the run reads or holds (the data files' heads, the checkpoint
    # folders, the memory plan): made once per launch, of a run about to start, after every
    # other entry's and the pipeline split (check_inputs; titan.runtime.inputs_checked)
    reads_inputs: bool = False
    # ignored(job) -> {key: why} for settings the config sets that this run does not use
    ignored: Callable | None = None
    # weight_copies(sections) -> how many float32 copies of each trained weight it keeps
    # beside the optimizer's state (sections: the job's added sections by name)
    weight_copies: Callable | None = None

    def __post_init__(self) -> None:
        if (self.section is None) != (self.options is None):
            raise ValueError(f"{self.kind} {self.name!r}: section and options come together")
        if self.options is not None and not dataclasses.is_dataclass(self.options):
            raise TypeError(f"section {self.section!r} must be a dataclass, got {self.options!r}")

    def unused(self, job) -> str | None:
        """Why `job` does not use this entry (None: it does)."""
        return None

    def options_in(self, sections: dict):
        """Its own section among a job's added sections (None without one)."""
        return sections[self.section] if self.section else None

    def ignored_settings(self, job) -> dict[str, str]:
        out = dict(self.ignored(job)) if self.ignored else {}
        why = self.unused(job) if self.section else None
        if why:
            keys = changed_keys(job, self.section, typed=self.typed_only)
            out.update({key: why for key in keys})
        return out


_ALL: dict[tuple[str, str], Entry] = {}  # every entry by (kind, name), in registration order
_loaded = False


def register(entry: Entry) -> None:
    """Add `entry`; the same entry again is a no-op (a plugin may be imported twice). titan's
    own are added first, whoever registers first: a run meets them before a plugin's."""
    load_builtin()
    taken = _ALL.get((entry.kind, entry.name))
    if taken == entry:
        return
    if taken is not None:
        article = "an" if entry.kind[0] in "aeiou" else "a"
        raise ValueError(
            f"{article} {entry.kind} named {entry.name!r} is already registered; register it "
            "under another name"
        )
    owner = section_owner(entry.section) if entry.section else None
    if owner is not None:
        raise ValueError(
            f"a config section named {entry.section!r} is already registered (by the "
            f"{owner.kind} {owner.name!r}); name the section otherwise"
        )
    _ALL[entry.kind, entry.name] = entry


def unregister(kind: str, name: str) -> None:
    _ALL.pop((kind, name), None)


def entries(kind: str | None = None) -> dict[str, Entry] | list[Entry]:
    """The entries of `kind` by name, in registration order; every entry (a list) when
    `kind` is None."""
    load_builtin()
    if kind is not None:
        return {name: e for (k, name), e in _ALL.items() if k == kind}
    return list(_ALL.values())


def section_owner(section: str) -> Entry | None:
    return next((e for e in _ALL.values() if e.section == section), None)


def sections() -> dict[str, object]:
    """A fresh instance of every registered section, by name, in registration order."""
    load_builtin()
    return {e.section: e.options() for e in _ALL.values() if e.section}


def check_job(job) -> None:
    """Every entry's check the job uses, in registration order."""
    for entry in entries():
        if entry.check and entry.unused(job) is None:
            _loaded_fn(entry.check)(job)


def check_plan(job, plan) -> None:
    """Every entry's plan check the job uses, in registration order, but those that read the
    run's inputs (`check_inputs`)."""
    _plan_checks(job, plan, reads_inputs=False)


def check_inputs(job, plan) -> None:
    """The plan checks that read what a run about to start reads or holds, where this process
    makes them (titan.runtime.inputs_checked)."""
    from titan.runtime.inputs_checked import checks_inputs

    if checks_inputs():
        _plan_checks(job, plan, reads_inputs=True)


def _plan_checks(job, plan, reads_inputs: bool) -> None:
    for entry in entries():
        if entry.plan_check and entry.reads_inputs == reads_inputs and entry.unused(job) is None:
            _loaded_fn(entry.plan_check)(job, plan)


def _loaded_fn(fn: Callable | str) -> Callable:
    return load(fn) if isinstance(fn, str) else fn


def weight_copies(sections: dict) -> int:
    return sum(e.weight_copies(sections) for e in entries() if e.weight_copies)


def ignored_options(job) -> dict[str, str]:
    """Every option the config sets that the run ignores, with why."""
    out: dict[str, str] = {}
    for entry in entries():
        out.update(entry.ignored_settings(job))
    return out


def changed_keys(job, section: str, typed: bool = False) -> list[str]:
    """The `section.key`s the config sets (TOML or command line; `typed`: the command line
    only) to other than the default."""
    obj = job.extensions.get(section) if section in job.extensions else getattr(job, section)
    default = type(obj)()
    return [
        key
        for key, source in job.sources.items()
        if key.startswith(section + ".")
        and (not typed or source.startswith("command line"))
        and getattr(obj, key.split(".", 1)[1], None) != getattr(default, key.split(".", 1)[1], None)
    ]


def load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            import_plugin(module)
