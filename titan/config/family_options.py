"""Config sections a model family owns: `[<family>]` in TOML, `--<family>.key` on the command
line, checked, sourced and listed by `--help` like every other section.

A family in titan/models/<family>/ declares its section in `options.py`, a torch-free module
that registers a `FamilySection` (its dataclass `Options`); titan.components.builtin loads it
by path, as it would a plugin's file, without the family's package (which imports torch). A
family defined elsewhere (a plugin, a test) gives its TrainSpec `options`. An option named
like a field of the family's ModelArgs, when set, overrides the flavor's value
(titan.plan.run_plan). The section of a family the run does not train is ignored, named so.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from titan.config import extensions
from titan.config.entry import Entry, register, section_owner, unregister


@dataclass(frozen=True)
class FamilySection(Entry):
    """A family's own section, named after it (`options`: its dataclass); its checks run when
    the run trains the family."""

    kind: ClassVar[str] = "family section"
    # another family's settings cannot apply, from a config file either
    typed_only: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.options is not None and self.section is None:
            object.__setattr__(self, "section", self.name)
        super().__post_init__()

    def unused(self, job) -> str | None:
        return None if job.model.name == self.name else f"this run trains {job.model.name}"


def register_family_options(family: str, options_cls: type) -> None:
    """Today's `register(FamilySection(family, options=options_cls))`."""
    extensions.said_once(
        "register_family_options(family, cls)",
        "titan.config.extensions.register(FamilySection(family, options=cls))",
    )
    register(FamilySection(family, options=options_cls))


def unregister_family_options(family: str) -> None:
    unregister(FamilySection.kind, family)


def _family_section(family: str) -> Entry | None:
    owner = section_owner(family)
    return owner if isinstance(owner, FamilySection) and owner.name == family else None


def options_of(job, family: str):
    """The job's `[family]` section, or None where the family declares none."""
    return job.extensions.get(family) if _family_section(family) else None


def option_names(family: str) -> set[str]:
    """The keys of the family's section (empty where it declares none)."""
    owner = _family_section(family)
    return {f.name for f in dataclasses.fields(owner.options)} if owner else set()
