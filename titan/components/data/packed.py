"""Indexed sources as packed windows: a token stream cut into `seq_len + 1` windows.

A source is a token-shard folder (scripts/pretokenize.py) or local files, which are tokenized
once into the same shard format in a cache and read memory-mapped from then on.
"""

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titan.components.data.batch import Batch, sample
from titan.components.data.dataset import DataError, iter_texts, with_progress
from titan.components.data.document_index import document_range, label_documents
from titan.components.data.token_shards import (
    META,
    ArrayTokens,
    ShardError,
    ShardWriter,
    TokenShards,
    encode_documents,
    is_shard_folder,
    tokenizer_fingerprint,
)
from titan.components.data.tokenizer import Tokenizer
from titan.components.training.loss import IGNORE_INDEX
from titan.runtime.paths import cache_dir, is_remote, local_copy

logger = logging.getLogger(__name__)


class PackedWindows(Dataset):
    """Window i of a token stream: (tokens[i*(L+1) : i*(L+1)+L], the same shifted by one).
    With `bos` (the id that opens each document) its documents can be named
    (`label_documents`) and some left out (`skip`: their labels IGNORE_INDEX wherever a window
    holds them; every other token stays where it was)."""

    def __init__(
        self,
        tokens: TokenShards | ArrayTokens | np.ndarray,
        seq_len: int,
        name: str = "dataset",
        bos: int | None = None,
    ):
        self.tokens = ArrayTokens(tokens) if isinstance(tokens, np.ndarray) else tokens
        self.seq_len, self.name, self.bos = seq_len, name, bos
        self.skipped: list[tuple[int, int]] = []  # stream ranges of left-out documents
        self.num_windows = len(self.tokens) // (seq_len + 1)
        if self.num_windows == 0:
            raise DataError(
                f"{name} has {len(self.tokens)} tokens, fewer than one sequence of seq_len + 1 "
                f"= {seq_len + 1}; use more data or a smaller training.seq_len"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> Batch:
        return self._sample(i * (self.seq_len + 1), self.seq_len)

    def piece(self, i: int, j: int, pieces: int) -> Batch:
        """Piece j of window i cut into `pieces`: its labels j x L/pieces .. (j+1) x L/pieces
        - 1 with the tokens before each as inputs (training.seq_len_schedule)."""
        length = self.seq_len // pieces
        return self._sample(i * (self.seq_len + 1) + j * length, length)

    def _sample(self, start: int, length: int) -> Batch:
        window = torch.from_numpy(self.tokens.read(start, length + 1))
        labels = window[1:]
        # label j predicts token start + j + 1
        spans = [(max(lo - start - 1, 0), min(hi - start - 1, length)) for lo, hi in self.skipped]
        spans = [(first, end) for first, end in spans if first < end]
        if spans:
            labels = labels.clone()  # a view of the inputs' tokens
            for first, end in spans:
                labels[first:end] = IGNORE_INDEX
        return sample(window[:-1], labels)

    def skip(self, documents: list[int]) -> None:
        self.skipped = [document_range(self.tokens, d, self.bos) for d in documents]

    def label_documents(self, i: int) -> np.ndarray:
        """The document (its index in this source) of each label of window i."""
        return label_documents(self.tokens, i * (self.seq_len + 1), self.seq_len, self.bos)


class MixedWindows(Dataset):
    """Indexed by (source, window), as `GlobalOrder` yields them. `fields`: the function that
    adds the batch fields of the sources' registered dataset (titan.components.data.dataset
    `sample_fields`), None where it adds none."""

    def __init__(self, sources: list[Dataset], fields: Callable | None = None):
        self.sources, self.fields = sources, fields

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def __getitem__(self, index: tuple[int, ...]):
        """(source, window), or (source, window, piece, pieces): a piece of the window."""
        source, window, *cut = index
        s = self.sources[source]
        return with_fields(s.piece(window, *cut) if cut else s[window], self.fields)


def with_fields(sample: Batch, fields: Callable | None) -> Batch:
    return sample if fields is None else {**sample, **fields(sample)}


def open_tokens(files: list[Path], tokenizer: Tokenizer, text_field: str) -> TokenShards:
    """The token stream of a local source: a shard folder as it is (its tokenizer checked),
    local files through the on-the-fly cache."""
    try:
        if len(files) == 1 and is_shard_folder(files[0]):
            folder = remote_shards(files[0]) if is_remote(files[0]) else files[0]
            return TokenShards(folder, tokenizer)
        return cached_tokens(files, tokenizer, text_field)
    except ShardError as e:
        raise DataError(str(e)) from None


def remote_shards(folder) -> Path:
    """A shard folder in object storage, copied once into the token cache (keyed by its URL
    and its meta.json, which names every shard and its size): memmaps read local files."""
    meta = (folder / META).read_text()
    key = hashlib.sha256(f"{folder}|{meta}".encode()).hexdigest()[:20]
    names = [*(s["file"] for s in json.loads(meta)["shards"]), META]
    logger.info("copying the token shards %s into the token cache, once", folder)
    return local_copy([folder / n for n in names], f"remote-tokens-{key}")


def _cache_key(files: list[Path], tokenizer: Tokenizer, text_field: str) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|".encode())
    h.update(f"{text_field}|{tokenizer_fingerprint(tokenizer)}".encode())
    return h.hexdigest()[:20]


def cached_tokens(files: list[Path], tokenizer: Tokenizer, text_field: str) -> TokenShards:
    """Tokenize local files once into a shard folder under TITAN_CACHE_DIR (default
    ~/.cache/titan), keyed by the files' paths, sizes and modification times and the
    tokenizer's fingerprint; later runs and the other ranks map it. Where the cache cannot
    be written, the shards go to a temporary folder for this run."""
    folder = cache_dir() / f"tokens-{_cache_key(files, tokenizer, text_field)}"
    if is_shard_folder(folder):
        try:
            return TokenShards(folder, tokenizer)
        except ShardError as e:
            logger.warning("token cache %s is unusable (%s); tokenizing again", folder, e)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        writer = ShardWriter(folder, tokenizer, sources=[str(f) for f in files])
    except OSError as e:
        import tempfile

        logger.info("token cache not writable (%s); tokenizing into a temporary folder", e)
        folder = Path(tempfile.mkdtemp(prefix="titan-tokens-")) / "shards"
        writer = ShardWriter(folder, tokenizer, sources=[str(f) for f in files])
    size = sum(f.stat().st_size for f in files)
    logger.info(
        "tokenizing %s (%.1f MB) into the token cache %s, once: later runs map it",
        files[0].name if len(files) == 1 else f"{len(files)} files",
        size / 1e6,
        folder,
    )
    try:
        docs = (
            ids
            for batch in encode_documents(tokenizer, iter_texts(files, text_field))
            for ids in batch
        )
        writer.add(
            with_progress(docs, lambda s: f"tokenizing: {writer.tokens} tokens so far ({s:.0f}s)")
        )
        return TokenShards(writer.close(), tokenizer)
    except BaseException:
        writer.abort()
        raise
