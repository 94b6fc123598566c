"""Where checkpoints live: a local folder, or any fsspec URL (`s3://bucket/prefix`,
`gs://...`) through universal-pathlib, whose paths answer the pathlib calls the folder rules
make (glob, is_dir, read_text, stat, unlink). What differs is here: removing a step's folder
(a prefix: every object under it), writing a small file whole (an object store writes an
object whole or not at all: no temp file and rename), DCP's reader for a folder, and the
one-line reasons a bucket cannot be used, found before any rank starts.

Credentials and endpoints are the store's own (AWS_* variables or profile, AWS_ENDPOINT_URL;
GCS application-default credentials): nothing titan-specific.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from titan.runtime.paths import as_path, is_remote, missing_package, scheme


def checkpoint_root(dump_folder: str, folder: str) -> Path:
    """The checkpoint root: `folder` when it is a URL, else under `dump_folder`."""
    return as_path(folder) if is_remote(folder) else Path(dump_folder) / folder


def remove_tree(path: Path) -> None:
    """Remove a step's folder and everything in it (a prefix: every object under it)."""
    if is_remote(path):
        if path.exists():
            path.fs.rm(path.path, recursive=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def make_folder(path: Path) -> None:
    if not is_remote(path):  # an object store has no folders: a prefix exists by its objects
        path.mkdir(parents=True, exist_ok=True)


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees all of it or no file: on a disk a synced
    temp file renamed into place; on an object store one upload (an object appears whole)."""
    if is_remote(path):
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dcp_reader(path: Path):
    """DCP's reader of a step folder: the file reader, or its fsspec one for a URL."""
    if is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path))
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


def store_problem(url: str) -> str | None:
    """Why the store behind `url` cannot be used (a missing package, bucket, credentials,
    access, an unreachable endpoint), or None; one network round trip."""
    if why := missing_package(url):
        return why
    path = as_path(url)
    bucket = str(url).split("://", 1)[1].split("/", 1)[0]
    try:
        path.fs.ls(bucket, detail=False)
    except FileNotFoundError:
        return f"the bucket {bucket!r} does not exist (create it, or fix the URL)"
    except PermissionError as e:
        return f"access to {bucket!r} is denied ({e}): check the credentials' permissions"
    except Exception as e:  # noqa: BLE001  each store raises its own kinds; the name says it
        name = type(e).__name__
        if "Credentials" in name or "credentials" in str(e).lower():
            return (
                f"no credentials for {scheme(url)}:// ({name}): set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or a profile (GCS: application-default credentials)"
            )
        if "Endpoint" in name or "connect" in str(e).lower():
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "the store's endpoint")
            return f"cannot reach {endpoint} ({name}: {e}): check AWS_ENDPOINT_URL and network"
        return f"cannot list {bucket!r} ({name}: {e})"
    return None
