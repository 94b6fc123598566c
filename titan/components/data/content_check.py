"""What the data and weight files hold: a plan check of a run about to start, made once per
launch (by the launcher, or by rank 0 of a run started without it: titan.runtime
.inputs_checked).

The data's other plan check finds that the files exist; this reads a little of them: sizes,
token-shard indexes, safetensors headers and the first lines of jsonl files, never a whole
dataset (a worker would otherwise find a bad file N times over, as a traceback per rank, and
again on every restart). What only a full read finds (a bad record in the middle of a file)
is the workers' to report (titan/runtime/final_error.py).
"""

import io
import json
from pathlib import Path

from titan.components.data.dataset import (
    DataError,
    chat_hint,
    check_messages,
    local_files,
    parse_mix,
)
from titan.components.data.token_shards import ShardError, is_shard_folder, verify
from titan.components.data.tokenizer import Tokenizer
from titan.config import ConfigError, JobConfig
from titan.runtime.paths import resolve

# enough to catch a file of the wrong kind, a wrong text field or a broken writer
FIRST_LINES = 8
LINE_LIMIT = 1 << 22  # a document per line may be long; longer first lines go unchecked


def plan_check(job: JobConfig, plan) -> None:
    check_content(job, plan.tokenizer)


def check_content(job: JobConfig, tokenizer: Tokenizer) -> None:
    """ConfigError naming the file and the fix for the first bad one."""
    chat = job.training.dataset_format == "chat"
    images = job.training.dataset_format == "images"
    field = job.chat.messages_field if chat else job.training.dataset_text_field
    for key, name, path in _local_sources(job):
        files = local_files(name, path)  # plan_run has refused missing paths already
        if files is None:
            continue  # a hub dataset: read by the workers
        try:
            if len(files) == 1 and is_shard_folder(files[0]):
                verify(files[0], tokenizer)
            else:
                for f in files:
                    if images:
                        check_image_file(f, job.images.image_field, field, job.chat.messages_field)
                    else:
                        check_text_file(f, field, chat)
        except (DataError, ShardError) as e:
            raise ConfigError(f"{key}: {e}") from None
    ck = job.checkpoint
    if ck.initial_load_in_hf and ck.initial_load_path:
        from titan.components.checkpoint.folders import CheckpointError
        from titan.components.checkpoint.hf_io import hf_weight_files

        try:
            hf_weight_files(resolve(ck.initial_load_path), ck.verify)
        except CheckpointError as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def _local_sources(job: JobConfig):
    """(config section, dataset name, dataset path) of every source the run reads."""
    t = job.training
    if t.dataset_mix:
        for name, _ in parse_mix(t.dataset_mix):
            yield "training.dataset_mix", name, None
    else:
        yield "training.dataset", t.dataset, t.dataset_path
    if job.validation.enable:
        yield "validation.dataset", job.validation.dataset, job.validation.dataset_path


def check_text_file(path: Path, text_field: str, chat: bool = False) -> None:
    """A DataError when the file is empty, or (jsonl) one of its first lines is not a JSON
    object with a string in `text_field` (`chat`: a conversation there)."""
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty; fill it or remove it from the dataset")
    key = "chat.messages_field" if chat else "training.dataset_text_field"
    if path.suffix == ".jsonl":
        _check_jsonl_head(path, text_field, chat)
    elif path.suffix == ".parquet":
        _check_parquet_schema(path, text_field, key)


def _head_records(path: Path, text_field: str):
    """(where, record) of the first lines of a JSON-lines file, each a JSON object (a
    DataError naming the line otherwise)."""
    with path.open("rb") as raw:  # a Path, or a UPath of a bucket (fsspec's file object)
        f = raw if isinstance(raw, io.BufferedIOBase) else io.BufferedReader(raw)
        for number in range(1, FIRST_LINES + 1):
            line = f.readline(LINE_LIMIT)
            if not line:
                return
            if not line.endswith(b"\n") and len(line) == LINE_LIMIT:
                return  # too long to read here; the workers read it whole
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                raise DataError(f"{where} is not UTF-8 text; re-encode the file as UTF-8") from None
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where} is not JSON ({e.msg} at column {e.colno}): a .jsonl "
                    "file holds one JSON object per line; fix or remove the file"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{where} is a JSON {type(record).__name__}, not an object "
                    f"with a '{text_field}' field; fix or remove the file"
                )
            yield where, record


def check_image_file(path: Path, image_field: str, text_field: str, messages_field: str) -> None:
    """Image-text records (training.dataset_format = "images"): the first lines of a JSON
    lines file name an image and hold a caption or a conversation."""
    if path.suffix != ".jsonl":
        return  # tar shards and parquet tables: read when the index is built
    for where, record in _head_records(path, text_field):
        if image_field not in record:
            raise DataError(
                f"{where} has no '{image_field}' field (fields: {sorted(record)[:8]}); set "
                "images.image_field to the field naming the image, or fix the file"
            )
        if not isinstance(record.get(text_field), str) and messages_field not in record:
            raise DataError(
                f"{where} has neither a caption in '{text_field}' nor a conversation in "
                f"'{messages_field}' (fields: {sorted(record)[:8]}); set "
                "training.dataset_text_field or chat.messages_field, or fix the file"
            )


def _check_jsonl_head(path: Path, text_field: str, chat: bool) -> None:
    for where, record in _head_records(path, text_field):
        if chat and text_field in record:
            check_messages(record[text_field], where, text_field)
        elif not isinstance(record.get(text_field), str) or chat:
            what = (
                f"a {type(record[text_field]).__name__} in '{text_field}'"
                if text_field in record
                else f"no '{text_field}' field"
            )
            key, holds = (
                ("chat.messages_field", "conversations")
                if chat
                else ("training.dataset_text_field", "text")
            )
            raise DataError(
                f"{where} has {what} (fields: {sorted(record)[:8]}); set {key} to the "
                f"field holding the {holds}, or fix the file" + ("" if chat else chat_hint(record))
            )


def _check_parquet_schema(path: Path, text_field: str, key: str) -> None:
    import pyarrow.parquet as pq

    try:
        with path.open("rb") as f:  # the footer only
            names = pq.read_schema(f).names
    except Exception as e:  # noqa: BLE001  pyarrow raises several types for a bad file
        raise DataError(
            f"{path} is not a readable parquet file ({type(e).__name__}: {e}); "
            "write it again or remove it"
        ) from None
    if text_field not in names:
        raise DataError(
            f"{path} has no column '{text_field}' (columns: {names[:8]}); set {key} to the "
            "column holding the data"
        )
