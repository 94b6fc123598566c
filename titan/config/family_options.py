"""Config sections a model family owns: `[<family>]` in TOML, `--<family>.key` on the command
line, checked, sourced and listed by `--help` like every other section.

A family in titan/models/<family>/ declares them in `options.py`, a torch-free module holding
one dataclass `Options` whose fields are made with `titan.config.job_config.opt`; it is loaded
on its own, without the family's package (which imports torch). A family defined elsewhere
(a plugin, a test) calls `register_family_options`. An option named like a field of the
family's ModelArgs, when set, overrides the flavor's value (titan.plan.run_plan).
"""

import dataclasses
import importlib.util
from pathlib import Path

_MODELS = Path(__file__).resolve().parent.parent / "models"
_REGISTERED: dict[str, type] = {}
_discovered: dict[str, type] | None = None


def register_family_options(family: str, options_cls: type) -> None:
    if not dataclasses.is_dataclass(options_cls):
        raise TypeError(f"options of {family!r} must be a dataclass, got {options_cls!r}")
    _REGISTERED[family] = options_cls


def unregister_family_options(family: str) -> None:
    _REGISTERED.pop(family, None)


def _discover() -> dict[str, type]:
    global _discovered
    if _discovered is None:
        _discovered = {}
        for path in sorted(_MODELS.glob("*/options.py")):
            spec = importlib.util.spec_from_file_location(
                f"_titan_family_options_{path.parent.name}", path
            )
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _discovered[path.parent.name] = module.Options
    return _discovered


def family_sections() -> dict[str, object]:
    """A fresh instance of every family's options, by family name."""
    return {name: cls() for name, cls in {**_discover(), **_REGISTERED}.items()}
