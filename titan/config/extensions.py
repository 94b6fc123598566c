"""What is added to titan without editing it: config sections, config checks (of the config
alone, and of the planned run), and the modules that register them (titan's own components'
and plugins').

A module registers here when imported; titan's own are imported by the module BUILTIN names
(titan.components.builtin) on first use, a plugin's by `--job.custom_import` (imported by the
launcher and by every worker before the config is parsed, so its sections appear in `--help`
and are checked like titan's own).
Everything here is torch-free: a config is checked before torch is imported.
"""

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

# titan's own registrations (its components' sections, checks and entries; its families'
# sections), loaded like plugins are
BUILTIN = ("titan.components.builtin",)

_SECTIONS: dict[str, type] = {}
_CHECKS: list[Callable] = []
_loaded = False


def register_section(name: str, options_cls: type) -> None:
    """`[name]` in TOML and `--name.key` on the command line, from a dataclass whose fields
    are made with `titan.config.job_config.opt` (their docs are --help's lines)."""
    if not dataclasses.is_dataclass(options_cls):
        raise TypeError(f"section {name!r} must be a dataclass, got {options_cls!r}")
    _SECTIONS[name] = options_cls


def unregister_section(name: str) -> None:
    _SECTIONS.pop(name, None)


def section_class(name: str) -> type | None:
    return _SECTIONS.get(name)


def registered_sections() -> list[str]:
    return list(_SECTIONS)


def register_check(check: Callable) -> None:
    """`check(cfg)` runs after titan's own config checks; it raises ConfigError (through
    titan.config.manager.require, which names the key and where its value came from)."""
    if check not in _CHECKS:
        _CHECKS.append(check)


def unregister_check(check: Callable) -> None:
    if check in _CHECKS:
        _CHECKS.remove(check)


_PLAN_CHECKS: list[Callable] = []


def register_plan_check(check: Callable) -> None:
    """`check(job, plan)` runs when the run is planned (titan.plan.run_plan.plan_run), once the
    model, the layout, the tokenizer and the device are known (`plan`: the RunPlan); it
    raises ConfigError, so a launch stops before any rank starts."""
    if check not in _PLAN_CHECKS:
        _PLAN_CHECKS.append(check)


_WEIGHT_COPIES: list[Callable] = []


def register_weight_copies(count: Callable) -> None:
    """`count(sections)` (a job's added sections by name) -> how many float32 copies of each
    trained weight a component keeps beside the optimizer's state (an average of the
    weights, say): the memory planner and the checkpoints' disk check count them."""
    if count not in _WEIGHT_COPIES:
        _WEIGHT_COPIES.append(count)


def weight_copies(sections: dict) -> int:
    _load_builtin()
    return sum(count(sections) for count in _WEIGHT_COPIES)


_IGNORED: list[Callable] = []


def register_ignored(find: Callable) -> None:
    """`find(job)` -> {key: why} for options the config sets that this run does not use (a
    family's section when another family trains, a switched-off feature's settings given on
    the command line: `changed_keys`, `ignored_when`); the launcher names them all in one
    warning."""
    if find not in _IGNORED:
        _IGNORED.append(find)


def ignored_options(job) -> dict[str, str]:
    """Every option the config sets that the run ignores, with why."""
    _load_builtin()
    out: dict[str, str] = {}
    for find in _IGNORED:
        out.update(find(job))
    return out


def ignored_warning(job) -> str | None:
    """One line naming every option the run ignores, grouped by why (None: none is)."""
    by_why: dict[str, list[str]] = {}
    for key, why in sorted(ignored_options(job).items()):
        by_why.setdefault(why, []).append(key)
    if not by_why:
        return None
    return "this run ignores " + "; ".join(
        f"{', '.join(keys)} ({why})" for why, keys in by_why.items()
    )


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


def ignored_when(job, section: str, off: bool, why: str, switch: str | None = None) -> dict:
    """{key: why} for the keys of `section` (but its `switch`) the command line sets when `off`:
    a config file's settings of a feature it switches off are a template to switch it on."""
    if not off:
        return {}
    return {k: why for k in changed_keys(job, section, typed=True) if k != f"{section}.{switch}"}


def plan_checks() -> list[Callable]:
    _load_builtin()
    return list(_PLAN_CHECKS)


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(module)


def sections() -> dict[str, object]:
    """A fresh instance of every registered section, by name."""
    _load_builtin()
    return {name: cls() for name, cls in _SECTIONS.items()}


def checks() -> list[Callable]:
    _load_builtin()
    return list(_CHECKS)


class Registry:
    """Named entries (optimizers, metrics writers), each with a `name` and optionally its own
    config section (`section`, the name; `options`, its dataclass), registered with it."""

    def __init__(self, kind: str):
        self.kind = kind
        self.entries: dict = {}

    def add(self, spec) -> None:
        if spec.name in self.entries:
            article = "an" if self.kind[0] in "aeiou" else "a"
            raise ValueError(
                f"{article} {self.kind} named {spec.name!r} is already registered; register "
                "it under another name"
            )
        if (spec.section is None) != (spec.options is None):
            raise ValueError(f"{self.kind} {spec.name!r}: section and options come together")
        self.entries[spec.name] = spec
        if spec.section:
            register_section(spec.section, spec.options)

    def remove(self, name: str) -> None:
        spec = self.entries.pop(name, None)
        if spec and spec.section:
            unregister_section(spec.section)

    def check(self, job, specs=None) -> None:
        """Each entry's own check on `job`, of `specs` (default: every entry)."""
        for spec in self.entries.values() if specs is None else specs:
            if spec.check:
                spec.check(job)

    def unused_sections(self, job, used: Callable, why: Callable) -> dict[str, str]:
        """{key: why(spec)} for the options of each entry's own section that the command line
        sets while `used(spec)` is false (for `register_ignored`)."""
        return {
            key: why(spec)
            for spec in self.entries.values()
            if spec.section and not used(spec)
            for key in changed_keys(job, spec.section, typed=True)
        }

    def options_of(self, spec, sections: dict):
        """The entry's own section among a job's added sections (None without one)."""
        return sections[spec.section] if spec.section else None


def load(path: str) -> Callable:
    """The function (or class) a "module:name" path names, imported now: entries name their
    builders so, and the config stays free of what the builders import."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class PluginImportError(ImportError):
    """A --job.custom_import that names no importable module; the message says which."""


def import_plugin(name: str):
    """Import a plugin: a dotted module on sys.path, or a path to a .py file."""
    if name.endswith(".py") or "/" in name:
        path = Path(name).resolve()
        if not path.is_file():
            raise PluginImportError(
                f"job.custom_import {name!r}: no such file; pass a .py file or a dotted module "
                "on PYTHONPATH"
            )
        module_name = f"titan_plugin_{path.stem}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001  whatever the plugin raises, named in one line
            sys.modules.pop(module_name, None)
            raise PluginImportError(_failed(name, e)) from None
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise PluginImportError(
                f"job.custom_import {name!r}: no module {e.name!r} on sys.path; add its folder "
                "to PYTHONPATH or pass the path of its .py file"
            ) from None
        raise PluginImportError(_failed(name, e)) from None
    except Exception as e:  # noqa: BLE001
        raise PluginImportError(_failed(name, e)) from None


def _failed(name: str, e: Exception) -> str:
    """One line for a plugin whose import raised `e`: where, what, and that it is the
    plugin's to fix."""
    import traceback

    if isinstance(e, SyntaxError):
        where = f"{e.filename}, line {e.lineno}"
        what = f"SyntaxError: {e.msg}"
    else:
        # the innermost frame outside titan's own files: the plugin's line that raised
        own = str(Path(__file__).resolve().parents[1])
        frames = [
            f
            for f in traceback.extract_tb(e.__traceback__)
            if own not in f.filename and not f.filename.startswith("<frozen")
        ]
        frame = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
        where = f"{frame.filename}, line {frame.lineno}"
        what = f"{type(e).__name__}: {e}"
    return f"job.custom_import {name!r}: importing it failed at {where}: {what}; fix the plugin"


def flag_values(argv: list[str], key: str) -> list[str]:
    """The values given to --`key` on a command line, in order, read before it is parsed
    (what they name may add the sections the rest of it sets)."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{key}="):
            out.append(arg.split("=", 1)[1])
        elif arg == f"--{key}" and i + 1 < len(argv):
            out.append(argv[i + 1])
    return out


def plugins_in(argv: list[str]) -> list[str]:
    """The --job.custom_import values of a command line (comma-separated or repeated)."""
    out = [p for value in flag_values(argv, "job.custom_import") for p in value.split(",")]
    return [p.strip() for p in out if p.strip()]
