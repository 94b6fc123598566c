"""What is added to titan without editing it, and the modules that add it: each registers
its entries (titan.config.entry: `register(Entry(...))`, the one door) when imported. titan's
own are imported by the module BUILTIN names (titan.components.builtin) on first use, a
plugin's by `--job.custom_import` (imported by the launcher and by every worker before the
config is parsed, so its sections appear in `--help` and are checked like titan's own).
Everything here is torch-free: a config is checked before torch is imported.
"""

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from titan.config.entry import (  # noqa: F401  the one door, and what reads the entries
    BUILTIN,
    Entry,
    changed_keys,
    check_job,
    check_plan,
    entries,
    ignored_options,
    load_builtin,
    register,
    section_owner,
    sections,
    unregister,
    weight_copies,
)


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


def ignored_when(job, section: str, off: bool, why: str, switch: str | None = None) -> dict:
    """{key: why} for the keys of `section` (but its `switch`) the command line sets when `off`:
    a config file's settings of a feature it switches off are a template to switch it on."""
    if not off:
        return {}
    return {k: why for k in changed_keys(job, section, typed=True) if k != f"{section}.{switch}"}


class Registry:
    """The entries of one kind, by name, as its owner asks for them."""

    def __init__(self, kind: str):
        self.kind = kind

    @property
    def entries(self) -> dict[str, Entry]:
        return entries(self.kind)

    def add(self, spec: Entry) -> None:
        register(spec)

    def remove(self, name: str) -> None:
        unregister(self.kind, name)

    def options_of(self, spec: Entry, added: dict):
        return spec.options_in(added)


# today's spellings of the one door, kept for plugins written against earlier docs: each
# registers an Entry and says once what it is called now
_said: set[str] = set()


def said_once(old: str, new: str) -> None:
    if old not in _said:
        _said.add(old)
        warnings.warn(f"{old} is now {new}", FutureWarning, stacklevel=3)


def _named(kind: str, fn: Callable) -> str:
    return f"{kind}:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_section(name: str, options_cls: type) -> None:
    said_once("register_section(name, cls)", "register(Entry(name, section=name, options=cls))")
    register(Entry(name, section=name, options=options_cls))


def unregister_section(name: str) -> None:
    owner = section_owner(name)
    if owner is not None:
        unregister(owner.kind, owner.name)


def register_check(check: Callable) -> None:
    said_once("register_check(check)", "register(Entry(name, check=check))")
    register(Entry(_named("check", check), check=check))


def unregister_check(check: Callable) -> None:
    unregister(Entry.kind, _named("check", check))


def register_plan_check(check: Callable) -> None:
    said_once("register_plan_check(check)", "register(Entry(name, plan_check=check))")
    register(Entry(_named("plan_check", check), plan_check=check))


def unregister_plan_check(check: Callable) -> None:
    unregister(Entry.kind, _named("plan_check", check))


def register_weight_copies(count: Callable) -> None:
    said_once("register_weight_copies(count)", "register(Entry(name, weight_copies=count))")
    register(Entry(_named("weight_copies", count), weight_copies=count))


def register_ignored(find: Callable) -> None:
    said_once("register_ignored(find)", "register(Entry(name, ignored=find))")
    register(Entry(_named("ignored", find), ignored=find))


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
        module_name = _module_name(path)
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


def _module_name(path: Path) -> str:
    """A file's module name: titan's own by where they sit in titan/ (its families' options.py
    files share a stem), a plugin's by its stem."""
    own = Path(__file__).resolve().parents[1]
    if path.is_relative_to(own):
        return "_titan_" + "_".join(path.relative_to(own).with_suffix("").parts)
    return f"titan_plugin_{path.stem}"


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
