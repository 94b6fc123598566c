"""Text datasets packed into fixed-length (input, label) windows, sharded by data-parallel rank.

Local files (jsonl/json/parquet/txt) are tokenized once into one token stream and cut into
`seq_len + 1` windows with a global index. Step s of training uses windows
[s*G, (s+1)*G) of the (per-epoch shuffled) order, G = global batch; dp rank r takes the
r-th contiguous slice of each global batch, as Megatron's pretraining sampler does. So the
set of sequences in every optimizer step is the same whatever the data-parallel degree,
and losses compare across layouts.

Hub datasets (and local files with `dataset_streaming`) are streamed; no global index exists
there, so each dp rank reads its own shard (`split_dataset_by_node`) and packs it on the fly:
losses then depend on the dp degree, and a resume must keep it.
"""

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

from titan.components.tokenizer import Tokenizer
from titan.paths import resolve

logger = logging.getLogger(__name__)

BUNDLED = {
    "kjv": "assets/corpus/kjv_train.jsonl",
    "kjv_valid": "assets/corpus/kjv_valid.jsonl",
}
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class DataShard:
    """Which slice of each global batch this rank reads."""

    dp_rank: int = 0
    dp_world_size: int = 1


def local_files(name: str, path: str | None,
                key: str = "training.dataset_path") -> list[Path] | None:
    """Files of a local dataset, or None when `name` must be a hub dataset. `key`: the
    config key that set `path`, for the error message."""
    candidate = path or BUNDLED.get(name) or name
    p = resolve(candidate)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in _FORMATS)
        if not files:
            raise DataError(f"dataset folder {p} holds no {'/'.join(_FORMATS)} files")
    elif path is not None:
        raise DataError(f"dataset path '{path}' does not exist; fix {key}")
    else:
        return None
    kinds = {_FORMATS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(
            f"dataset files {[str(f) for f in files][:3]} must all be one of "
            f"{', '.join(_FORMATS)}"
        )
    return files


def _open_local(files: list[Path], streaming: bool):
    """(HF dataset of the files, the column holding the text)."""
    from datasets import load_dataset

    fmt = _FORMATS[files[0].suffix]
    kwargs = {"sample_by": "paragraph"} if fmt == "text" else {}
    kwargs.update(streaming=True) if streaming else kwargs.update(keep_in_memory=True)
    return load_dataset(fmt, data_files=[str(f) for f in files], split="train", **kwargs), fmt


def _text_column(ds, fmt: str, text_field: str, where) -> str:
    field = "text" if fmt == "text" else text_field
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise DataError(
            f"dataset {where} has no column '{field}' (columns: {columns}); "
            "set training.dataset_text_field"
        )
    return field


def _load_local_texts(files: list[Path], text_field: str) -> list[str]:
    ds, fmt = _open_local(files, streaming=False)
    return ds[_text_column(ds, fmt, text_field, files[0])]


def tokenize_stream(texts: list[str], tokenizer: Tokenizer, chunk: int = 1024) -> np.ndarray:
    """All documents as one stream, each wrapped in BOS ... EOS."""
    parts = []
    for i in range(0, len(texts), chunk):
        for ids in tokenizer.encode_batch(texts[i:i + chunk]):
            parts.append(np.asarray(ids, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class PackedDataset(IterableDataset):
    """Globally indexed packed windows of a local token stream; checkpointable in O(1)."""

    # its position is a count of global batches: the same on every rank, for any dp degree
    global_index = True

    def __init__(self, tokens: np.ndarray, seq_len: int, dp_rank: int, dp_world_size: int,
                 global_batch_size: int, seed: int, shuffle: bool, infinite: bool = True,
                 name: str = "dataset"):
        if global_batch_size % dp_world_size:
            raise DataError(
                f"global batch {global_batch_size} is not divisible by the dp degree {dp_world_size}"
            )
        self.tokens = torch.from_numpy(tokens)
        self.seq_len = seq_len
        self.num_windows = len(tokens) // (seq_len + 1)
        if self.num_windows == 0:
            raise DataError(
                f"{name} has {len(tokens)} tokens, fewer than one sequence of seq_len + 1 = "
                f"{seq_len + 1}; use more data or a smaller training.seq_len"
            )
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // dp_world_size
        self.seed, self.shuffle, self.infinite, self.name = seed, shuffle, infinite, name
        self.sample_idx = 0  # samples this rank has yielded so far
        self._perm_epoch, self._perm = -1, None

    def stream_position(self, j: int) -> int:
        """Position in the global stream of this rank's j-th sample."""
        step, within = divmod(j, self.per_rank)
        return step * self.global_batch_size + self.dp_rank * self.per_rank + within

    def _window(self, g: int) -> int:
        epoch, pos = divmod(g, self.num_windows)
        if not self.shuffle:
            return pos
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def __iter__(self):
        while True:
            g = self.stream_position(self.sample_idx)
            if not self.infinite and g >= self.num_windows - self.num_windows % self.global_batch_size:
                return
            prev = self.stream_position(self.sample_idx - 1) if self.sample_idx else 0
            if g // self.num_windows > prev // self.num_windows:
                logger.info("%s: all %d sequences seen, starting epoch %d",
                            self.name, self.num_windows, g // self.num_windows)
            start = self._window(g) * (self.seq_len + 1)
            window = self.tokens[start:start + self.seq_len + 1]
            self.sample_idx += 1
            yield window[:-1], window[1:]

    def state_dict(self) -> dict:
        batches, offset = divmod(self.sample_idx, self.per_rank)
        return {"global_batches": batches, "offset": offset}

    def load_state_dict(self, state: dict) -> None:
        self.sample_idx = int(state["global_batches"]) * self.per_rank + int(state["offset"])

    def rewind(self) -> None:
        self.sample_idx = 0

    def seek_global_batch(self, batches: int) -> None:
        """Continue at the start of global batch `batches` (a torchft heal jumps steps)."""
        self.sample_idx = batches * self.per_rank


def _open_hub(name: str):
    from datasets import load_dataset

    repo, _, subset = name.partition(":")  # "allenai/c4:en" names a subset
    try:
        return load_dataset(repo, subset or None, split="train", streaming=True)
    except Exception as e:  # noqa: BLE001  any hub failure gets one actionable message
        from datasets import config as hf_config

        # the libraries read the switches once, at import: ask them, not os.environ
        offline = hf_config.HF_HUB_OFFLINE
        raise DataError(
            f"training.dataset '{name}' is neither a bundled name ({', '.join(BUNDLED)}) nor "
            f"a local path, and loading it from the HF hub failed"
            f"{' (HF offline mode is set)' if offline else ''}: {type(e).__name__}: {e}. "
            "Without network access, point training.dataset_path at local "
            "jsonl/json/parquet/txt files."
        ) from None


class StreamingPackedDataset(IterableDataset):
    """A streamed dataset (a hub name, or local files), split per dp rank and packed on the fly.

    Infinite: every pass over the stream is an epoch. Finite (validation): one pass.
    """

    global_index = False

    def __init__(self, name: str, files: list[Path] | None, tokenizer: Tokenizer, seq_len: int,
                 shard: DataShard, text_field: str, infinite: bool = True):
        from datasets.distributed import split_dataset_by_node

        if files is None:
            ds, field = _open_hub(name), text_field
        else:
            ds, fmt = _open_local(files, streaming=True)
            field = _text_column(ds, fmt, text_field, files[0])
        self.ds = split_dataset_by_node(ds, rank=shard.dp_rank, world_size=shard.dp_world_size)
        self.tokenizer, self.seq_len, self.text_field = tokenizer, seq_len, field
        self.infinite, self.name = infinite, name
        self.epoch, self.buffer = 0, []
        self._start = self.state_dict()

    def __iter__(self):
        while True:
            self.ds.set_epoch(self.epoch)
            for sample in self.ds:
                text = sample.get(self.text_field)
                if not isinstance(text, str):
                    raise DataError(
                        f"{self.name}: a record has no text in field '{self.text_field}' "
                        f"(fields: {sorted(sample)}); set training.dataset_text_field")
                self.buffer.extend(self.tokenizer.encode(text))
                while len(self.buffer) > self.seq_len:
                    window = torch.tensor(self.buffer[:self.seq_len + 1])
                    self.buffer = self.buffer[self.seq_len + 1:]
                    yield window[:-1], window[1:]
            if not self.infinite:
                return
            self.epoch += 1
            logger.info("%s: stream exhausted, starting epoch %d", self.name, self.epoch)

    def state_dict(self) -> dict:
        return {"ds": self.ds.state_dict(), "buffer": list(self.buffer), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.ds.load_state_dict(state["ds"])
        self.buffer, self.epoch = list(state["buffer"]), int(state["epoch"])

    def rewind(self) -> None:
        self.load_state_dict(self._start)

    def seek_global_batch(self, batches: int) -> None:
        raise DataError(f"{self.name} is streamed: it has no global index to seek to batch "
                        f"{batches}; use a local dataset without dataset_streaming")


def _cache_path(files: list[Path], tokenizer: Tokenizer, text_field: str) -> Path:
    h = hashlib.sha256()
    for f in [*files, tokenizer.path]:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|".encode())
    h.update(f"{text_field}|{tokenizer.bos_id}|{tokenizer.eos_id}".encode())
    root = Path(os.environ.get("TITAN_CACHE_DIR", "~/.cache/titan")).expanduser()
    return root / f"tokens-{h.hexdigest()[:20]}.npy"


def load_token_stream(files: list[Path], tokenizer: Tokenizer, text_field: str) -> np.ndarray:
    """Tokenize local files once; later runs (and the other ranks) read the cached stream.

    The cache key covers the files' and the tokenizer's paths, sizes and modification times;
    TITAN_CACHE_DIR moves the cache (default ~/.cache/titan). A cache that cannot be written
    only costs the re-tokenization.
    """
    path = _cache_path(files, tokenizer, text_field)
    if path.is_file():
        try:
            return np.load(path)
        except (OSError, ValueError):
            logger.warning("token cache %s is unreadable; re-tokenizing", path)
    tokens = tokenize_stream(_load_local_texts(files, text_field), tokenizer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, tokens)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
    except OSError as e:
        logger.info("token cache not written (%s)", e)
    return tokens


def build_dataset(*, dataset: str, dataset_path: str | None, tokenizer: Tokenizer,
                  seq_len: int, shard: DataShard, global_batch_size: int, seed: int,
                  text_field: str = "text", shuffle: bool = True, infinite: bool = True,
                  streaming: bool = False) -> IterableDataset:
    files = local_files(dataset, dataset_path)
    if files is None or streaming:
        return StreamingPackedDataset(dataset, files, tokenizer, seq_len, shard, text_field,
                                      infinite)
    tokens = load_token_stream(files, tokenizer, text_field)
    return PackedDataset(tokens, seq_len, shard.dp_rank, shard.dp_world_size, global_batch_size,
                         seed, shuffle, infinite, name=dataset)
