"""Config sections a model family owns: `[<family>]` in TOML, `--<family>.key` on the command
line, checked, sourced and listed by `--help` like every other section: they are sections of
titan.config.extensions, named after the family.

A family in titan/models/<family>/ declares them in `options.py`, a torch-free module holding
one dataclass `Options`; it is loaded on its own, by path, without the family's package
(which imports torch), with titan's own registrations (`register_titan_families`). A family
defined elsewhere (a plugin, a test) calls `register_family_options`. An option named like a
field of the family's ModelArgs, when set, overrides the flavor's value (titan.plan.run_plan).
"""

import importlib.util
from pathlib import Path

from titan.config import extensions

_MODELS = Path(__file__).resolve().parent.parent / "models"


def register_family_options(family: str, options_cls: type) -> None:
    """`[family]`: a section like any other (a dataclass of `opt` fields)."""
    if family in extensions.registered_sections() and family not in _families:
        raise ValueError(f"a config section named {family!r} is already registered")
    extensions.register_section(family, options_cls)
    _families.add(family)


def unregister_family_options(family: str) -> None:
    extensions.unregister_section(family)
    _families.discard(family)


def options_of(job, family: str):
    """The job's `[family]` section, or None where the family declares none."""
    return job.extensions.get(family) if family in _families else None


_families: set[str] = set()


def option_names(family: str) -> set[str]:
    """The keys of the family's section (empty where it declares none)."""
    import dataclasses

    cls = extensions.section_class(family) if family in _families else None
    return {f.name for f in dataclasses.fields(cls)} if cls is not None else set()


def _other_families(job) -> dict[str, str]:
    return {
        key: f"this run trains {job.model.name}"
        for family in sorted(_families - {job.model.name})
        for key in extensions.changed_keys(job, family)
    }


extensions.register_ignored(_other_families)


def register_titan_families() -> None:
    """titan's own families' sections (titan/components/builtin.py calls it, in --help's
    order)."""
    for path in sorted(_MODELS.glob("*/options.py")):
        spec = importlib.util.spec_from_file_location(
            f"_titan_family_options_{path.parent.name}", path
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        register_family_options(path.parent.name, module.Options)
