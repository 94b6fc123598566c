"""Where image-text records come from, each image read only when a loader worker asks:
- local JSON lines / JSON / parquet files whose records name their image files (a path, or
  a list of paths, relative to the file that names them) beside their text;
- WebDataset-style tar shards (a .tar file, or a folder of them, local or in object storage):
  the members of one key are one record, its image `KEY.jpg|jpeg|png|webp` and its text
  `KEY.txt` (or the text field of `KEY.json`);
- a Hugging Face dataset whose image column is `datasets`' Image feature (a hub name, or
  local parquet files that hold one): read as the stored bytes, decoded in the workers.

A record is an `ImageRecord`: references to its images, their sizes (read from the image
headers when the index is built, so that each sample's token count is known before any pixel
is decoded), its text and where it came from ("FILE: record N"), which every error names.
"""

import contextlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from titan.components.data.dataset import (
    DataError,
    local_files,
    location_of,
    open_hub,
    open_local,
)
from titan.components.data.images import pil
from titan.runtime.paths import is_remote, local_copy, resolve

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


@dataclass(frozen=True)
class ImageRecord:
    images: tuple  # what the source's `read` takes, one per image
    sizes: tuple[tuple[int, int], ...]  # (height, width) of each
    text: str  # a caption; "" for a conversation
    where: str
    # a conversation about the images (image chat): {role, content} messages whose content
    # holds one {"type": "image"} part per image
    messages: list | None = None


@contextlib.contextmanager
def _opened(data, where: str, trouble: str):
    """The PIL image of `data` (a path or bytes); a missing or bad file is one DataError
    naming the record (`trouble`: what a bad one is said to be)."""
    try:
        with pil().open(data if isinstance(data, (str, Path)) else io.BytesIO(data)) as im:
            yield im
    except FileNotFoundError:
        raise DataError(f"{where}: image {data} does not exist; fix or drop that record") from None
    except Exception as e:  # noqa: BLE001  PIL raises many types for bad files
        raise DataError(
            f"{where}: the image is {trouble} ({type(e).__name__}: {e}); fix or drop that record"
        ) from None


def decoded(data, where: str):
    """The whole RGB image of `data` (a path or bytes); a missing, unreadable or truncated
    image is one DataError naming it (never half an image)."""
    with _opened(data, where, "unreadable or truncated") as im:
        im.load()  # a truncated file raises here, not later
        return im.convert("RGB")


def _size(data, where: str) -> tuple[int, int]:
    """(height, width) from the image's header."""
    with _opened(data, where, "unreadable") as im:
        return im.height, im.width


class FileImages:
    """Records of local files naming their images."""

    def __init__(self, files: list[Path], image_field: str, text_field: str, messages_field: str):
        self.files, self.image_field, self.text_field = files, image_field, text_field
        self.messages_field = messages_field

    def records(self):
        for f in self.files:
            ds, _ = open_local([f])
            for n, row in enumerate(ds, 1):
                where = f"{f}: record {n}"
                paths = row.get(self.image_field)
                paths = [paths] if isinstance(paths, str) else paths
                if not paths or not all(isinstance(p, str) for p in paths):
                    raise DataError(
                        f"{where} has no image path in field '{self.image_field}' (a path or "
                        "a list of paths); fix or drop that record, or set images.image_field"
                    )
                full = tuple(str(f.parent / p) for p in paths)
                sizes = tuple(_size(p, where) for p in full)
                yield _record(full, sizes, row, self.text_field, self.messages_field, where)

    def read(self, path: str, where: str):
        return decoded(path, where)


class TarImages:
    """Records of WebDataset-style tar shards; an image is read at its offset in its shard."""

    def __init__(self, shards: list[Path], text_field: str, messages_field: str):
        self.shards, self.text_field, self.messages_field = shards, text_field, messages_field

    def records(self):
        for shard in self.shards:
            with tarfile.open(shard) as tar:
                groups: dict[str, dict[str, tarfile.TarInfo]] = {}
                for m in tar.getmembers():
                    if m.isfile():
                        key, _, ext = m.name.partition(".")
                        groups.setdefault(key, {})[ext.lower()] = m
                for key, members in groups.items():
                    where = f"{shard}: record {key}"
                    image = next((members[e[1:]] for e in IMAGE_SUFFIXES if e[1:] in members), None)
                    if image is None:
                        raise DataError(
                            f"{where} has no image ({', '.join(IMAGE_SUFFIXES)}): fix the shard"
                        )
                    row = self._row(tar, members, where)
                    ref = (str(shard), image.offset_data, image.size)
                    size = _size(tar.extractfile(image).read(), where)
                    yield _record((ref,), (size,), row, self.text_field, self.messages_field, where)

    def _row(self, tar, members, where) -> dict:
        if "txt" in members:
            return {self.text_field: tar.extractfile(members["txt"]).read().decode("utf-8")}
        if "json" in members:
            return json.loads(tar.extractfile(members["json"]).read())
        raise DataError(f"{where} has no text (KEY.txt or KEY.json): fix the shard")

    def read(self, ref, where: str):
        path, offset, size = ref
        with open(path, "rb") as f:
            f.seek(offset)
            return decoded(f.read(size), where)


class DatasetImages:
    """Records of an HF dataset whose image column is `datasets`' Image feature, as bytes."""

    def __init__(self, dataset, name: str, image_field: str, text_field: str, messages_field: str):
        from datasets import Image

        columns = dataset.column_names
        if image_field not in columns:
            raise DataError(
                f"dataset {name} has no column '{image_field}' (columns: {columns}); set "
                "images.image_field"
            )
        if text_field not in columns and messages_field not in columns:
            raise DataError(
                f"dataset {name} has neither a text column '{text_field}' nor a conversation "
                f"column '{messages_field}' (columns: {columns}); set training.dataset_text_field"
            )
        self.dataset = dataset.cast_column(image_field, Image(decode=False))
        self.name, self.image_field, self.text_field = name, image_field, text_field
        self.messages_field = messages_field

    def records(self):
        for n, row in enumerate(self.dataset):
            where = f"{self.name}: record {n + 1}"
            size = _size(self._bytes(row[self.image_field], where), where)
            yield _record((n,), (size,), row, self.text_field, self.messages_field, where)

    def _bytes(self, image, where):
        if not image or not (image.get("bytes") or image.get("path")):
            raise DataError(f"{where} has no image; fix or drop that record")
        return image["bytes"] or image["path"]

    def read(self, row: int, where: str):
        return decoded(self._bytes(self.dataset[row][self.image_field], where), where)


def _record(images, sizes, row: dict, text_field: str, messages_field: str, where: str):
    """A caption record (its text), or a conversation (its messages) where it holds them."""
    messages = row.get(messages_field)
    if messages is None:
        return ImageRecord(images, sizes, _text(row, text_field, where), where)
    check_image_messages(messages, len(images), where, messages_field)
    return ImageRecord(images, sizes, "", where, messages)


def check_image_messages(messages, images: int, where: str, field: str) -> None:
    """A conversation about `images` images: {role, content} messages, an assistant turn,
    content as text or parts of type text and image, one image part per image."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field '{field}' is not a list of messages; fix that record")
    parts = 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        kinds = (
            [p.get("type") for p in content if isinstance(p, dict)]
            if isinstance(content, list)
            else []
        )
        if not isinstance(content, str) and (not kinds or set(kinds) - {"text", "image"}):
            raise DataError(
                f"{where}: message {i + 1} has content that is neither text nor parts of type "
                "text and image; fix that record"
            )
        parts += kinds.count("image")
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, nothing to train on; fix or drop it")
    if parts != images:
        raise DataError(
            f"{where} has {parts} image placeholder(s) ({{'type': 'image'}} parts) for "
            f"{images} image(s); give each image one"
        )


def _text(row: dict, field: str, where: str) -> str:
    text = row.get(field)
    if not isinstance(text, str):
        raise DataError(
            f"{where} has no text in field '{field}'; fix or drop that record, or set "
            "training.dataset_text_field"
        )
    return text


def local_shards(shards: list) -> list[Path]:
    """Tar shards in object storage, copied once into the local cache (keyed by their URLs
    and sizes, alike on every rank): images are read at their offsets in local files."""
    import hashlib

    listing = [(str(s), s.stat().st_size) for s in shards]
    key = hashlib.sha256(repr(listing).encode()).hexdigest()[:20]
    folder = local_copy(shards, f"image-shards-{key}")
    return [folder / s.name for s in shards]


def open_image_source(
    name: str,
    path: str | None,
    image_field: str,
    text_field: str,
    key: str,
    messages_field: str = "messages",
):
    """The source of training.dataset / dataset_path: tar shards, local files, or a hub
    dataset."""
    where = path or location_of(name)
    p = resolve(where)
    if p.suffix == ".tar" or (p.is_dir() and any(p.glob("*.tar"))):
        shards = [p] if p.suffix == ".tar" else sorted(p.glob("*.tar"))
        shards = local_shards(shards) if is_remote(where) else shards
        return TarImages(shards, text_field, messages_field)
    files = local_files(name, path, key=key)
    if files is not None and files[0].suffix != ".parquet":
        return FileImages(files, image_field, text_field, messages_field)
    if files is None:
        return DatasetImages(
            open_hub(name, key.removesuffix("_path"), streaming=False),
            name,
            image_field,
            text_field,
        )
    from datasets import load_dataset

    # parquet: an Image feature's bytes are in the file
    ds = load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    return DatasetImages(ds, name, image_field, text_field, messages_field)
