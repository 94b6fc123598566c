"""Tensor-at-a-time access to saved models, for tools that must not hold a whole model: read one
tensor of a DCP checkpoint (chunk by chunk, as its ranks wrote it) or of an HF folder, and write
a DCP model-only checkpoint or safetensors files whose tensors are made as they are written.

DCP's own reader copies each chunk into a destination tensor (two copies alive); here each
chunk is handed over as torch.load gives it, so a caller that folds it into an accumulator
holds the accumulator and one chunk. Its writer asks a planner for each tensor as it writes
it (`resolve_data`): with a file per tensor, one tensor is alive at a time.
"""

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from titan.components.checkpoint.folders import MODEL_KEY, CheckpointError, _quiet_no_dist
from titan.components.checkpoint.storage import as_path, dcp_reader
from titan.runtime.dtypes import safetensors_dtype


class _Window(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, seekable, as a file of its own."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


class DCPModelReader:
    """The model tensors of a DCP checkpoint folder: names, shapes, dtypes, and each tensor's
    chunks one at a time."""

    def __init__(self, path: Path):
        self.path = as_path(path)  # a folder, or a URL of one in object storage
        reader = dcp_reader(self.path)
        md = reader.read_metadata()
        reader.set_up_storage_reader(md, is_coordinator=True)
        self._storage = reader.storage_data
        planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
        self.tensors: dict[str, tuple[str, TensorStorageMetadata]] = {}
        for key, meta in md.state_dict_metadata.items():
            fqn = planner_data.get(key, tuple(key.split(".", 1)))
            if len(fqn) == 2 and fqn[0] == MODEL_KEY and isinstance(meta, TensorStorageMetadata):
                self.tensors[fqn[1]] = (key, meta)
        if not self.tensors:
            raise CheckpointError(f"{str(self.path)!r} holds no '{MODEL_KEY}.*' tensors")

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(m.size), m.properties.dtype) for n, (_, m) in self.tensors.items()}

    def chunks(self, name: str) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
        """(where in the whole tensor, the chunk) for each chunk of `name` as saved."""
        key, meta = self.tensors[name]
        for chunk in meta.chunks:
            info = self._storage[MetadataIndex(key, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{self.path}: {name} was saved through storage transforms "
                    f"{info.transform_descriptors}, which this reader does not undo"
                )
            with (self.path / info.relative_path).open("rb") as f:
                window = io.BufferedReader(_Window(f, info.offset, info.length))
                tensor = torch.load(window, map_location="cpu", weights_only=True)
            where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            yield where, tensor


class _MadeOnWrite(DefaultSavePlanner):
    """A planner whose tensors are made by `make(name)` as the writer reaches them."""

    def __init__(self, make: Callable[[str], torch.Tensor]):
        super().__init__()
        self.make = make

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        name = fqn.split(".", 1)[1]  # "model.<name>"
        return self.make(name)


def write_dcp_model(
    path: Path,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    make: Callable[[str], torch.Tensor],
) -> None:
    """A model-only DCP checkpoint `{"model": ...}` in `path` (no marker: the caller writes
    it), each tensor made by `make(name)` when written, in a file of its own; with
    `.checksums.json` sidecars (titan.components.checkpoint.integrity)."""
    from titan.components.checkpoint.integrity import ChecksummingWriter

    placeholders = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in shapes.items()}
    with _quiet_no_dist():
        dcp.save(
            {MODEL_KEY: placeholders},
            storage_writer=ChecksummingWriter(str(path), single_file_per_rank=False),
            planner=_MadeOnWrite(make),
            no_dist=True,
        )


# ------------------------------------------------------------------ safetensors


def safetensors_header(file: Path) -> dict:
    """A safetensors file's header: {name: {dtype, shape, data_offsets}, "__metadata__": ...}."""
    with open(file, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def read_safetensor(file: Path, name: str, header: dict | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, read into memory of its own (no mapping of the file,
    whose touched pages would count against the process too)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = header or json.loads(f.read(n))
        meta = header[name]
        start, end = meta["data_offsets"]
        out = torch.empty(end - start, dtype=torch.uint8)
        f.seek(8 + n + start)
        if f.readinto(memoryview(out.numpy())) != end - start:
            raise CheckpointError(f"{file} is truncated at {name}: download or copy it again")
    return out.view(safetensors_dtype(meta["dtype"])).reshape(meta["shape"])


def safetensors_shapes(header: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of a safetensors header (`safetensors_header`)."""
    return {
        k: (tuple(v["shape"]), safetensors_dtype(v["dtype"]))
        for k, v in header.items()
        if k != "__metadata__"
    }


def write_safetensors(file: Path, header: dict, make: Callable[[str], torch.Tensor]) -> None:
    """A safetensors file with `header`'s names, shapes, dtypes and order (another file's),
    each tensor made by `make(name)` as its bytes are written."""
    names = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )
    out, offset = {}, 0
    if "__metadata__" in header:
        out["__metadata__"] = header["__metadata__"]
    for name in names:
        meta = header[name]
        dtype = safetensors_dtype(meta["dtype"])
        n = torch.Size(meta["shape"]).numel() * dtype.itemsize
        out[name] = {**meta, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in names:
            tensor = make(name).contiguous()
            if list(tensor.shape) != header[name]["shape"]:
                raise ValueError(f"{name}: made {tuple(tensor.shape)}, the header says otherwise")
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # no copy
