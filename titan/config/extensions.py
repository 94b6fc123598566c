"""What is added to titan without editing it, and the modules that add it: each registers
its entries (titan.config.entry: `register(Entry(...))`, the one door) when imported. titan's
own are imported by the module BUILTIN names (titan.components.builtin) on first use, a
plugin's by `--job.custom_import` (imported by the launcher and by every worker before the
config is parsed, so its sections appear in `--help` and are checked like titan's own).
Everything here is torch-free: a config is checked before torch is imported.
"""

import warnings
from collections.abc import Callable

from titan.config.entry import (  # noqa: F401  the one door, and what reads the entries
    BUILTIN,
    Entry,
    changed_keys,
    check_inputs,
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
from titan.config.plugins import (  # noqa: F401  how modules that register are found
    PluginImportError,
    flag_values,
    import_plugin,
    load,
    plugins_in,
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


# today's spellings of the one door, kept for plugins written against earlier docs: each
# registers an Entry and says once what it is called now
_said: set[str] = set()


def said_once(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn once that `old` is now `new`, at the line of the caller's caller (the plugin's)."""
    if old not in _said:
        _said.add(old)
        warnings.warn(f"{old} is now {new}", FutureWarning, stacklevel=stacklevel)


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
