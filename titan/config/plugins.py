"""How the modules that register entries are found: a plugin named by --job.custom_import (a
dotted module, or the path of a .py file) and titan's own (titan.config.entry.BUILTIN), the
same one way; and the builders entries name by "module:function". Torch-free."""

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path


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
