"""Build a JobConfig from defaults < TOML file < command line, failing early and clearly.

Kept free of torch so that a bad config is reported in a fraction of a second,
before a process group, a folder or a log file exists.
"""

import copy
import dataclasses
import difflib
import os
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

import titan.config.extensions as extensions
from titan.config.job_config import JobConfig
from titan.runtime.paths import resolve


class ConfigError(ValueError):
    """A config problem a user must fix; the message names the key, its source and the fix."""


def _sections(cfg: JobConfig) -> dict[str, Any]:
    own = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, f.name))
    }
    return {**own, **cfg.extensions}


def _field_types(section_obj) -> dict[str, Any]:
    return typing.get_type_hints(type(section_obj))


def _all_keys(cfg: JobConfig) -> list[str]:
    return [f"{s}.{f.name}" for s, obj in _sections(cfg).items() for f in dataclasses.fields(obj)]


def did_you_mean(name: str, choices: list[str]) -> str:
    """ "; did you mean 'X'?" for the closest of `choices`, or "" when none is close."""
    # case-insensitive, so 'adamw' suggests 'AdamW' rather than 'Adam'
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean '{lowered[close[0]]}'?" if close else ""


def _unwrap_optional(tp):
    """(inner type, allows None)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp) -> str:
    inner, nullable = _unwrap_optional(tp)
    if get_origin(inner) is Literal:
        name = "|".join(str(a) for a in get_args(inner))
    elif get_origin(inner) is list and dataclasses.is_dataclass(get_args(inner)[0]):
        keys = ", ".join(f.name for f in dataclasses.fields(get_args(inner)[0]))
        name = f"list of tables {{{keys}}}"
    elif get_origin(inner) is list:
        name = f"list[{get_args(inner)[0].__name__}] (comma-separated)"
    else:
        name = inner.__name__
    return f"{name} or None" if nullable else name


def _coerce(value, tp, key: str, source: str):
    """Check/convert one value against a field type. Strings come from the CLI."""
    inner, nullable = _unwrap_optional(tp)
    from_cli = source.startswith("command line")

    def bad(why=""):
        raise ConfigError(f"{key} = {value!r} (from {source}) is not a valid {_type_name(tp)}{why}")

    if value is None or (nullable and value in ("None", "none", "null")):
        if nullable:
            return None
        bad()
    if get_origin(inner) is Literal:
        choices = get_args(inner)
        if value not in choices:
            hint = did_you_mean(str(value), [str(c) for c in choices])
            bad(f"; choose one of {', '.join(map(str, choices))}{hint}")
        return value
    if get_origin(inner) is list and dataclasses.is_dataclass(get_args(inner)[0]):
        return _coerce_tables(value, get_args(inner)[0], key, source, bad)
    if get_origin(inner) is list:
        elem = get_args(inner)[0]
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            bad()
        return [
            _coerce(v.strip() if isinstance(v, str) else v, elem, key, source)
            for v in items
            if not (isinstance(v, str) and not v.strip())
        ]
    if inner is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "1", "yes"):
            return True
        if from_cli and isinstance(value, str) and value.lower() in ("false", "0", "no"):
            return False
        bad()
    if inner in (int, float):
        # TOML ints are fine for float fields, never the reverse; bools are not numbers here
        accepted = (int,) if inner is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return inner(value)
        if from_cli and isinstance(value, str):
            try:
                return inner(value)
            except ValueError:
                bad()
        bad()
    if inner is str:
        if isinstance(value, str):
            return value
        bad()
    raise TypeError(f"unsupported config type {tp} for {key}")


def _coerce_tables(value, cls, key: str, source: str, bad) -> list:
    """A list of tables (TOML's [[section.key]] or inline form; the inline form on the command
    line) as a list of `cls`, each table's keys checked against its fields."""
    if isinstance(value, str):
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as e:
            bad(f" (write it as TOML's inline array of tables, '[{{key = value, ...}}, ...]': {e})")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        bad()
    types_ = typing.get_type_hints(cls)
    out = []
    for i, table in enumerate(value):
        unknown = sorted(set(table) - set(types_))
        if unknown:
            bad(
                f": table {i} has unknown key '{unknown[0]}'"
                f"{did_you_mean(unknown[0], list(types_))} (keys: {', '.join(types_)})"
            )
        out.append(
            cls(**{k: _coerce(v, types_[k], f"{key}[{i}].{k}", source) for k, v in table.items()})
        )
    return out


def _lookup(cfg: JobConfig, dotted: str, source: str):
    """(section object, field name, field type) for 'section.key', or a ConfigError."""
    sections = _sections(cfg)
    if "." not in dotted:
        raise ConfigError(
            f"'{dotted}' (from {source}) is not of the form section.key"
            f"{did_you_mean(dotted, _all_keys(cfg))}"
        )
    section, key = dotted.split(".", 1)
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}' (from {source})"
            f"{did_you_mean(section, list(sections))} Sections: {', '.join(sections)}."
        )
    obj = sections[section]
    types_ = _field_types(obj)
    if key not in types_:
        raise ConfigError(
            f"unknown config key '{dotted}' (from {source})"
            f"{did_you_mean(dotted, _all_keys(cfg))} See --help for every key."
        )
    return obj, key, types_[key]


def _apply_toml(cfg: JobConfig, path: str, sources: dict[str, str]) -> None:
    source = f"config file {path}"
    path = str(resolve(path))
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file '{path}' does not exist; pass an existing TOML file with "
            "--job.config_file (or CONFIG_FILE=... for run_train.sh)"
        )
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"'{section}' (from {source}) must be a [section] table, not a top-level value"
            )
        for key, value in table.items():
            if (section, key) == ("job", "config_file"):
                raise ConfigError(
                    f"job.config_file (from {source}): a config file cannot name another (it "
                    "would be ignored); pass the file with --job.config_file on the command "
                    "line (CONFIG_FILE=... for run_train.sh)"
                )
            obj, name, tp = _lookup(cfg, f"{section}.{key}", source)
            setattr(obj, name, _coerce(value, tp, f"{section}.{key}", source))
            sources[f"{section}.{key}"] = source


def _parse_cli(cfg: JobConfig, argv: list[str]) -> list[tuple[str, Any, str]]:
    """Turn argv into (dotted key, raw value, source) triples; bool flags become True/False."""
    out = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        source = f"command line '{arg}'"
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument '{arg}' on the command line; overrides look like "
                "--section.key value (see --help)"
            )
        body = arg[2:]
        value = None
        if "=" in body:
            body, value = body.split("=", 1)
        section, _, key = body.partition(".")
        negated = key.startswith("no_")
        if negated and section in _sections(cfg):
            obj = _sections(cfg)[section]
            types_ = _field_types(obj)
            if key not in types_ and types_.get(key[3:]) is bool:
                if value is not None:
                    raise ConfigError(f"{arg}: a --{section}.no_x flag takes no value")
                out.append((f"{section}.{key[3:]}", False, source))
                i += 1
                continue
        _, name, tp = _lookup(cfg, body, source)
        if value is None:
            if tp is bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
                value = True
            elif i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                # a value that starts with -- is passed as --section.key=--value
                raise ConfigError(f"--{body} (on the command line) needs a value")
            else:
                i += 1
                value = argv[i]
                source = f"command line '--{body} {value}'"
        out.append((body, value, source))
        i += 1
    return out


# what run_train.sh trains without CONFIG_FILE: every entry point starts from the same file
DEFAULT_CONFIG_FILE = "train_configs/debug_model.toml"


def with_config_file(argv: list[str]) -> list[str]:
    """`argv` led by --job.config_file when it names none: CONFIG_FILE's, else the debug
    config, as run_train.sh does."""
    if any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in argv):
        return list(argv)
    return ["--job.config_file", os.environ.get("CONFIG_FILE", DEFAULT_CONFIG_FILE), *argv]


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """defaults < TOML (--job.config_file) < CLI, then cross-field validation."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import_plugins(argv)
    cfg = JobConfig()
    sources: dict[str, str] = {}
    overrides = _parse_cli(cfg, argv)
    config_files = [v for k, v, _ in overrides if k == "job.config_file"]
    if config_files and config_files[-1] not in (None, "", "None"):
        _apply_toml(cfg, config_files[-1], sources)
    for dotted, value, source in overrides:
        _set(cfg, dotted, value, source, sources)
    cfg.sources = sources
    validate(cfg)
    return cfg


def import_plugins(argv: list[str]) -> None:
    """Import the plugins named by --job.custom_import on the command line or in the config
    file it names, before anything is parsed: they may add the sections the rest sets."""
    names = extensions.plugins_in(argv)
    path = next(reversed(extensions.flag_values(argv, "job.config_file")), None)
    if path and os.path.isfile(resolve(path)):
        try:
            with open(resolve(path), "rb") as f:
                listed = tomllib.load(f).get("job", {}).get("custom_import", [])
        except tomllib.TOMLDecodeError:
            listed = []  # reported, with its line, when the file is read for its values
        names = [
            n for n in (listed if isinstance(listed, list) else [listed]) if isinstance(n, str)
        ] + names
    for name in names:
        try:
            extensions.import_plugin(name)
        except extensions.PluginImportError as e:
            raise ConfigError(str(e)) from None


def _set(cfg: JobConfig, dotted: str, value, source: str, sources: dict[str, str]) -> None:
    obj, name, tp = _lookup(cfg, dotted, source)
    setattr(obj, name, _coerce(value, tp, dotted, source))
    sources[dotted] = source


def with_overrides(cfg: JobConfig, values: dict[str, Any], source: str) -> JobConfig:
    """A copy of `cfg` with `values` ({"section.key": value}) set as the command line's
    are: each checked against its field, recorded as coming from `source` (for the errors
    that name it), then the whole config validated again. For tools that choose settings
    (the planner's --suggest), so a setting the parser would refuse is refused here too."""
    out = copy.deepcopy(cfg)
    out.sources = dict(cfg.sources)
    for dotted, value in values.items():
        _set(out, dotted, value, source, out.sources)
    validate(out)
    return out


def source_of(cfg: JobConfig, key: str) -> str:
    """Where a value came from, for error messages: a file, the command line, or the default."""
    return cfg.sources.get(key, "the default")


def require(cfg: JobConfig, ok: bool, key: str, why: str) -> None:
    """Raise a ConfigError naming key, its value and where it came from, unless ok."""
    if not ok:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        raise ConfigError(f"{key} = {value!r} (from {source_of(cfg, key)}): {why}")


def require_all(cfg: JobConfig, checks) -> None:
    """`require` of each (ok, key, why) in turn: the first that fails raises."""
    for ok, key, why in checks:
        require(cfg, ok, key, why)


def validate(cfg: JobConfig) -> None:
    """Checks that need only the config itself (model/world-size checks come later): every
    entry's own (titan.config.entry), the core sections' first."""
    extensions.check_job(cfg)


# fault injection for titan's own tests: listed apart, after the options of real runs
TEST_HOOK_SECTIONS = ("debug",)


def help_text(argv: list[str] = ()) -> str:
    """--help's text, with the sections of the plugins `argv` imports."""
    import_plugins(list(argv))
    cfg = JobConfig()
    lines = [
        "usage: ./run_train.sh [--section.key VALUE | --section.key=VALUE | --section.flag |"
        " --section.no_flag] ...",
        "",
        "Precedence: command line > TOML file (--job.config_file) > defaults.",
        "Lists are comma-separated. Environment of run_train.sh: NGPU (ranks per node, >= 1),",
        "CONFIG_FILE, LOG_RANK (local ranks shown), MAX_RESTARTS, NNODES, RDZV_ENDPOINT,",
        "NODE_RANK, RDZV_ID, RDZV_CONF, DRY_RUN (see README).",
    ]
    sections = _sections(cfg)
    real = [s for s in sections if s not in TEST_HOOK_SECTIONS]
    hooks = [s for s in sections if s in TEST_HOOK_SECTIONS]
    for section in real:
        lines += _section_help(section, sections[section])
    lines += [
        "",
        "=" * 78,
        "TESTING HOOKS: fault injection for titan's own tests (NaN losses, hung or killed",
        "ranks). They break a run on purpose; never set them for training.",
        "=" * 78,
    ]
    for section in hooks:
        lines += _section_help(section, sections[section])
    return "\n".join(lines)


def _section_help(section: str, obj) -> list[str]:
    lines = [f"\n[{section}]"]
    types_ = _field_types(obj)
    for f in dataclasses.fields(obj):
        flag = f"--{section}.{f.name}"
        default = getattr(obj, f.name)
        lines.append(f"  {flag:<44} {f.metadata['doc']}")
        lines.append(f"  {'':<44} ({_type_name(types_[f.name])}, default: {default!r})")
    return lines


_TOML_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_char(c: str) -> str:
    """One character of a TOML basic string: quotes, backslashes and controls escaped."""
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\u{ord(c):04X}"
    return c


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + "".join(_toml_char(c) for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if dataclasses.is_dataclass(v):
        # TOML has no null: an unset key of a table is left out
        return (
            "{"
            + ", ".join(
                f"{f.name} = {_toml_value(getattr(v, f.name))}"
                for f in dataclasses.fields(v)
                if getattr(v, f.name) is not None
            )
            + "}"
        )
    return repr(v)


def as_dict(cfg: JobConfig) -> dict[str, dict]:
    """The merged config as {section: {key: value}}, every section (core, components',
    families', plugins') alike: what to_toml writes, for a W&B run's config."""
    return {section: dataclasses.asdict(obj) for section, obj in _sections(cfg).items()}


def to_toml(cfg: JobConfig) -> str:
    """The merged config in TOML form, usable as a run's config file (CONFIG_FILE): the file
    it was read from is a comment, it does not ask to print itself again, and the test hooks'
    section holds only the hooks set."""
    out = []
    for section, obj in _sections(cfg).items():
        default = type(obj)()
        lines = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if section in TEST_HOOK_SECTIONS and v == getattr(default, f.name):
                continue
            if (section, f.name) == ("job", "config_file"):  # a config file names no other
                lines.append(
                    f"# {f.name} = {_toml_value(v)} (these values came from it)"
                    if v
                    else f"# {f.name} = None"
                )
            elif (section, f.name) == ("job", "print_config"):
                lines.append(f"{f.name} = false")
            else:
                # TOML has no null: an unset optional is shown commented out
                lines.append(f"# {f.name} = None" if v is None else f"{f.name} = {_toml_value(v)}")
        if lines or section not in TEST_HOOK_SECTIONS:
            out += [f"[{section}]", *lines, ""]
    return "\n".join(out)
