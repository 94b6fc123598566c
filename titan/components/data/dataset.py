"""Where training text comes from: bundled names, local files or folders, token-shard
folders written by scripts/pretokenize.py, and HF hub datasets; and reading their documents
with errors that name the file and record.

Indexed sources (local files, token shards) are packed into windows with a global index
(`packed.py`) and ordered by `data_order.py`; hub datasets and local files with
`dataset_streaming` are packed on the fly (`streaming.py`).
"""

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from titan.components.data.token_shards import is_shard_folder
from titan.config import extensions
from titan.config.entry import Entry, register
from titan.runtime.paths import resolve

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetSpec(Entry):
    """A name for training.dataset and validation.dataset: `location` is a local file or
    folder (absolute, or relative to the repo), or a hub dataset (`org/name`,
    `org/name:subset`). `fields`: "module:function", function(tokenizer) -> a function of
    one sample (the mapping of titan.components.data.batch) returning the batch fields the
    dataset adds to it (a family reads those it lists in `batch_fields`)."""

    kind: ClassVar[str] = "dataset"
    location: str
    fields: str | None = None


# titan's bundled corpus, and what plugins add
_DATASETS = extensions.Registry(DatasetSpec.kind)
for _name, _location in (
    ("kjv", "assets/corpus/kjv_train.jsonl"),
    ("kjv_valid", "assets/corpus/kjv_valid.jsonl"),
    ("chat", "assets/corpus/chat_train.jsonl"),
    ("chat_valid", "assets/corpus/chat_valid.jsonl"),
    # pictures of shapes with their captions (training.dataset_format = "images")
    ("shapes", "assets/images/shapes/train.jsonl"),
    ("shapes_valid", "assets/images/shapes/valid.jsonl"),
    # the same pictures as image-chat records (a question, the caption as the answer)
    ("shapes_chat", "assets/images/shapes/chat_train.jsonl"),
    ("shapes_chat_valid", "assets/images/shapes/chat_valid.jsonl"),
):
    register(DatasetSpec(_name, _location))
unregister_dataset = _DATASETS.remove


def register_dataset(spec: DatasetSpec | str, location: str | None = None) -> None:
    """`register_dataset(name, location)` or `register_dataset(spec)`: today's
    `register(DatasetSpec(name, location))`."""
    extensions.said_once(
        "register_dataset(...)", "titan.config.extensions.register(DatasetSpec(name, location))"
    )
    register(spec if isinstance(spec, DatasetSpec) else DatasetSpec(spec, location))


def dataset_spec(name: str) -> DatasetSpec | None:
    return _DATASETS.entries.get(name)


def location_of(name: str) -> str:
    """Where a dataset name is read from: a registered name's location, else the name."""
    spec = dataset_spec(name)
    return spec.location if spec else name


def check_same_fields(names: list[str]) -> None:
    """Samples of one batch must carry the same fields: every source of a mix adds the same
    ones (DataError naming each source's)."""
    added = {name: getattr(dataset_spec(name), "fields", None) for name in names}
    if len(set(added.values())) > 1:
        listed = ", ".join(f"{n}: {f or 'none'}" for n, f in added.items())
        raise DataError(
            f"training.dataset_mix: its sources add different batch fields ({listed}); a "
            "batch's samples must carry the same fields: mix datasets that add the same ones"
        )


def sample_fields(name: str, tokenizer) -> Callable | None:
    """The function that adds a registered dataset's batch fields to each of its samples
    (None: it adds none)."""
    spec = dataset_spec(name)
    if spec is None or spec.fields is None:
        return None
    return extensions.load(spec.fields)(tokenizer)


_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class DataShard:
    """Which slice of each global batch this rank reads."""

    dp_rank: int = 0
    dp_world_size: int = 1


def local_files(
    name: str, path: str | None, key: str = "training.dataset_path"
) -> list[Path] | None:
    """Files of a local dataset ([the folder] for a token-shard folder), or None when `name`
    must be a hub dataset. `key`: the config key that set `path` (its section's `dataset`
    key set `name`), for the error message."""
    name_key = key.removesuffix("_path")
    candidate = path or location_of(name)
    p = resolve(candidate)
    if is_shard_folder(p):
        return [p]
    if p.is_file():
        files = [p]
    elif p.is_dir():
        named = sorted(f for f in p.rglob("*") if f.suffix in _FORMATS)
        broken = [f for f in named if f.is_symlink() and not f.exists()]
        if broken:
            raise DataError(
                f"dataset folder {p}: {broken[0]} is a link to {os.readlink(broken[0])}, "
                "which does not exist; fix or remove the link"
            )
        files = [f for f in named if f.is_file()]  # a sub-folder named x.jsonl is a folder
        if not files:
            raise DataError(f"dataset folder {p} holds no {'/'.join(_FORMATS)} files")
    elif p.exists():
        raise DataError(
            f"dataset path '{candidate}' is neither a file nor a folder (a named pipe or a "
            "device): datasets are read, indexed and re-read from files; write the data to a "
            f"{'/'.join(_FORMATS)} file"
        )
    elif path is not None:
        raise DataError(f"dataset path '{path}' does not exist; fix {key}")
    elif _looks_local(name):
        raise DataError(
            f"{name_key} '{name}' does not exist (a local path, by its form; a "
            "hub dataset is named like allenai/c4); fix the path"
        )
    else:
        return None
    suffixes = sorted({f.suffix for f in files})
    if len(suffixes) > 1:
        raise DataError(
            f"dataset folder {p} mixes file formats ({', '.join(suffixes)}: e.g. "
            + ", ".join(next(f.name for f in files if f.suffix == s) for s in suffixes)
            + "); keep one format per dataset, or name the parts in training.dataset_mix"
        )
    if files[0].suffix not in _FORMATS:
        raise DataError(
            f"{files[0]} is a {files[0].suffix or 'suffix-less'} file; datasets are "
            f"{', '.join(_FORMATS)} files"
        )
    return files


def _looks_local(name: str) -> bool:
    """A name that can only be a path: absolute, relative to here or home, or a data file."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).suffix in _FORMATS


def parse_mix(entries: list[str], key: str = "training.dataset_mix") -> list[tuple[str, float]]:
    """SOURCE=WEIGHT entries as (source, weight) pairs."""
    mix = []
    for entry in entries:
        source, sep, weight = entry.rpartition("=")
        try:
            w = float(weight)
        except ValueError:
            w = None
        if not sep or not source or w is None or not w > 0:
            raise DataError(
                f"{key} entry {entry!r} is not SOURCE=WEIGHT with a weight > 0, e.g. data/web=0.7"
            )
        mix.append((source, w))
    if len({s for s, _ in mix}) != len(mix):
        raise DataError(f"{key} names a source twice: {entries}")
    return mix


def open_local(files: list[Path]):
    """(the files as a streamed HF dataset: nothing held in memory, their format)."""
    from datasets import load_dataset

    # its loaders log each error they then raise, which DataError reports with the file
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    fmt = _FORMATS[files[0].suffix]
    kwargs = {"sample_by": "paragraph"} if fmt == "text" else {}
    return load_dataset(
        fmt, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs
    ), fmt


def with_progress(items, line: Callable[[float], str], every_s: float = 5.0):
    """`items`, logging `line(seconds so far)` every `every_s` seconds of a slow read
    (tokenizing a corpus, rendering chat data)."""
    start = last = time.monotonic()
    for item in items:
        yield item
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            logger.info("%s", line(now - start))


def chat_hint(fields) -> str:
    """For records read as text that have no text field: if they look like chat data, say
    how to read them so."""
    if any(f in fields for f in ("messages", "conversations")):
        return '; these records look like chat data: set training.dataset_format = "chat"'
    return ""


def text_column(ds, fmt: str, text_field: str, where) -> str:
    field = "text" if fmt == "text" else text_field
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise DataError(
            f"dataset {where} has no column '{field}' (columns: {columns}); "
            "set training.dataset_text_field" + chat_hint(columns)
        )
    return field


def _text_check(value, where: str, field: str) -> None:
    if not isinstance(value, str):
        raise DataError(
            f"{where} has no text in field '{field}' ({type(value).__name__}); fix or drop "
            "that record"
        )


def check_messages(value, where: str, field: str) -> None:
    """A conversation is a non-empty list of {role, content} with text in both. Content given
    as OpenAI-style parts ([{"type": "text", "text": ...}, ...]) becomes their text, joined
    (in place)."""
    if value is None:
        raise DataError(
            f"{where} has no field '{field}'; fix or drop that record, or set chat.messages_field"
        )
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field '{field}' is not a list of messages ({type(value).__name__}"
            f"{', empty' if isinstance(value, list) else ''}); fix or drop that record"
        )
    for i, message in enumerate(value):
        problem = None
        if not isinstance(message, dict):
            problem = f"is a {type(message).__name__}, not a {{role, content}} object"
        elif not isinstance(message.get("role"), str) or not message["role"]:
            problem = "has no role"
        elif isinstance(message.get("content"), list):
            problem = _join_parts(message)
        if problem is None and not isinstance(message.get("content"), str):
            problem = f"({message['role']}) has no text content"
        elif problem is None and not message["content"].strip():
            problem = f"({message['role']}) has empty content"
        if problem:
            raise DataError(f"{where}: message {i + 1} {problem}; fix or drop that record")
    if not any(m["role"] == "assistant" for m in value):
        raise DataError(f"{where}: no assistant message, nothing to train on; fix or drop it")


def _join_parts(message: dict) -> str | None:
    """OpenAI-style content parts to their text, in place; why not, if they are not text."""
    parts = message["content"]
    kinds = sorted({p.get("type") if isinstance(p, dict) else type(p).__name__ for p in parts})
    if kinds != ["text"] or not all(isinstance(p.get("text"), str) for p in parts):
        return (
            f"({message['role']}) has content parts of type {', '.join(map(str, kinds))}: only "
            "text parts ({'type': 'text', 'text': ...}) are trained"
        )
    message["content"] = "".join(p["text"] for p in parts)
    return None


def iter_texts(files: list[Path], text_field: str, batch_size: int = 1024):
    """The documents of local files in order, in lists of up to `batch_size` texts; bad data
    raises a DataError naming the file and record. Read as a stream: memory stays flat."""
    return iter_column(files, text_field, _text_check, "training.dataset_text_field", batch_size)


def iter_column(files: list[Path], field: str, check, key: str, batch_size: int = 1024):
    """One column of local files' records in order, in lists of up to `batch_size` values,
    each passed to `check(value, "FILE: record N", field)` first (N counts from 1; it raises
    a DataError).
    `key`: the config key naming the column. Plain-text files' column is their text."""
    for f in files:
        fmt = _FORMATS[f.suffix]
        column = "text" if fmt == "text" else field
        n = 0
        try:
            if f.stat().st_size == 0:
                raise DataError(f"{f} holds no records; remove the empty file or fill it")
            ds, _ = open_local([f])
            for batch in ds.iter(batch_size=batch_size):
                values = batch.get(column)
                if values is None:
                    hint = chat_hint(batch) if key == "training.dataset_text_field" else ""
                    raise DataError(
                        f"{f} has no field '{column}' (fields: {sorted(batch)}); set {key}{hint}"
                    )
                for i, value in enumerate(values):
                    check(value, f"{f}: record {n + i + 1}", column)  # from 1, as lines
                n += len(values)
                yield values
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001  datasets/pyarrow raise many types for bad files
            bad = _bad_jsonl_line(f) if f.suffix == ".jsonl" else None
            if bad is not None:
                raise DataError(
                    f"{f}, line {bad[0]}: not a JSON record ({bad[1]}); fix or remove that line"
                ) from None
            what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"unreadable as {fmt}"
            raise DataError(
                f"{f} is {what} after record {n}: {type(e).__name__}: {e}; fix or remove the file"
            ) from None
        if n == 0:
            raise DataError(f"{f} holds no records; remove the empty file or fill it")


def _bad_jsonl_line(f: Path) -> tuple[int, str] | None:
    """(line number, why) of the first line of a JSON-lines file that is no JSON object: the
    reader's own error counts rows within a block, not lines of the file."""
    import json

    with f.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError:
                return number, "not UTF-8 text"
            except json.JSONDecodeError as e:
                return number, f"{e.msg}, column {e.colno}"
            if not isinstance(record, dict):
                return number, f"a JSON {type(record).__name__}, not an object"
    return None


def _hub_unreachable() -> str | None:
    """Why the HF hub cannot be reached (None: it can, or offline mode reads the cache):
    asked once, in 3 s, instead of the libraries' retries (half a minute of warnings)."""
    import socket
    from urllib.parse import urlparse

    from datasets import config as hf_config

    if hf_config.HF_HUB_OFFLINE:
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or 443
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        return f"{host} cannot be reached ({type(e).__name__}: {e})"
    return None


def open_hub(name: str, key: str = "training.dataset", streaming: bool = True):
    """A hub dataset's train split: streamed, or (`streaming=False`: read at random, as
    image records are) downloaded into the HF cache."""
    from datasets import load_dataset

    repo, _, subset = location_of(name).partition(":")  # "allenai/c4:en" names a subset
    unreachable = _hub_unreachable()
    if unreachable:
        raise DataError(
            f"{key} '{name}' is neither a registered name ({', '.join(_DATASETS.entries)}) nor "
            f"a local path, and the HF hub is not reachable: {unreachable}. Without network "
            f"access, point {key}_path at local jsonl/json/parquet/txt files (or set "
            "HF_HUB_OFFLINE=1 to read the hub's local cache)"
        )
    try:
        return load_dataset(repo, subset or None, split="train", streaming=streaming)
    except Exception as e:  # noqa: BLE001  any hub failure gets one actionable message
        from datasets import config as hf_config

        # the libraries read the switches once, at import: ask them, not os.environ
        offline = hf_config.HF_HUB_OFFLINE
        raise DataError(
            f"{key} '{name}' is neither a registered name ({', '.join(_DATASETS.entries)}) nor "
            f"a local path, and loading it from the HF hub failed"
            f"{' (HF offline mode is set)' if offline else ''}: {type(e).__name__}: "
            f"{str(e).rstrip('.')}. Without network access, point {key}_path at local "
            "jsonl/json/parquet/txt files."
        ) from None
