"""Checksums of a checkpoint's files, taken on the bytes as DCP writes them.

A file of the right size can still hold the wrong bytes (a bad disk, a partial overwrite): its
size says nothing, and a resume from it trains on garbage. So every file of a save is
checksummed (CRC-32, about 6 GiB/s on one core) while it is written, by the process that
writes it (DCP's saving process for an async save): nothing is read back, and an async save
costs training no more than before. Each writer leaves its files' checksums in a small
sidecar; rank 0 folds them into the `.complete` marker when it marks the save complete.

`checkpoint.verify`: "full" re-reads every file against its checksum before a resume (spread
over the ranks, each reading its share), "fast" compares sizes only, "off" trusts the marker.
"""

import contextlib
import io
import json
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from titan.components.checkpoint.storage import as_path, is_remote, write_whole

SIDECAR_SUFFIX = ".checksums.json"
_READ_CHUNK = 16 << 20


class _ChecksummingStream(io.RawIOBase):
    """Passes writes through to `raw` and folds each one into a CRC-32. DCP writes a file
    front to back (its items' offsets come from tell()), so the CRC is that of the file."""

    def __init__(self, raw):
        super().__init__()
        self.raw, self.crc, self.size = raw, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.raw.write(b)
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()  # an object store's stream has none: DCP then skips fsync

    def flush(self) -> None:
        self.raw.flush()


class _Summing:
    """A DCP file system (on disk, or fsspec's) whose write streams checksum what passes."""

    sums: dict[str, list[int]]  # file name -> [crc32, size]

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            wrapped = _ChecksummingStream(stream)
            yield wrapped
            wrapped.flush()
            name = str(path).rstrip("/").rsplit("/", 1)[-1]
            # .metadata is written as .metadata.tmp, then renamed
            self.sums[name.removesuffix(".tmp")] = [wrapped.crc, wrapped.size]


class _SummingFileSystem(_Summing, FileSystem):
    def __init__(self):
        super().__init__()
        self.sums = {}


class _SummingFsspec(_Summing, FsspecFileSystem):
    def __init__(self):
        super().__init__()
        self.sums = {}


class _ChecksummingWriting:
    """DCP's file writer, leaving `<prefix>.checksums.json` beside the files it wrote."""

    def __init__(self, path, on_write=None, **kwargs):
        super().__init__(path, **kwargs)
        if isinstance(self, FsspecWriter):
            self.fs = _SummingFsspec()
            self.path = self.fs.init_path(path)
        else:
            self.fs = _SummingFileSystem()
        self.on_write = on_write  # called as this rank starts writing its files

    def write_data(self, plan, planner):
        if self.on_write is not None:
            self.on_write()
        self.fs.sums.clear()
        future = super().write_data(plan, planner)  # done when it returns: files are closed
        folder = as_path(str(self.path))
        write_whole(
            folder / f"{plan.storage_data.prefix}{SIDECAR_SUFFIX}", json.dumps(self.fs.sums)
        )
        return future

    def finish(self, metadata, results) -> None:
        self.fs.sums.clear()
        super().finish(metadata, results)
        folder = as_path(str(self.path))
        write_whole(folder / f"metadata{SIDECAR_SUFFIX}", json.dumps(self.fs.sums))


class ChecksummingWriter(_ChecksummingWriting, FileSystemWriter):
    pass


class RemoteChecksummingWriter(_ChecksummingWriting, FsspecWriter):
    """The same through fsspec, for a folder on an object store (a URL)."""


def checksumming_writer(path, **kwargs):
    """The checksumming DCP writer for a step folder: on disk, or on an object store."""
    cls = RemoteChecksummingWriter if is_remote(path) else ChecksummingWriter
    return cls(str(path), **kwargs)


def collect_sidecars(folder: Path) -> dict[str, list[int]]:
    """Every writer's checksums in `folder`, merged; the sidecars are removed by the caller
    once the marker that holds them is in place."""
    sums: dict[str, list[int]] = {}
    for sidecar in sorted(folder.glob(f"*{SIDECAR_SUFFIX}")):
        sums.update(json.loads(sidecar.read_text()))
    return sums


def remove_sidecars(folder: Path) -> None:
    for sidecar in folder.glob(f"*{SIDECAR_SUFFIX}"):
        sidecar.unlink(missing_ok=True)


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_problem(folder: Path, name: str, expected: list[int], full: bool) -> str | None:
    """Why `name` does not hold what was written (None if it does): missing, another size,
    or (full) another checksum."""
    path = folder / name
    crc, size = expected
    if not path.is_file():
        return f"missing file {name}"
    actual = path.stat().st_size
    if actual != size:
        return f"file {name} has {actual} bytes, {size} were written"
    if full and file_crc32(path) != crc:
        return f"file {name} fails its checksum (its bytes changed after the save)"
    return None
