"""Token shards: a folder of flat token files, read memory-mapped, indexed by its meta.json.

Format: raw numpy memmaps (`shard-00000.bin`, uint16 when the vocabulary fits, else uint32)
and `meta.json` with each shard's token and document counts and a fingerprint of the
tokenizer that wrote them. Why not Arrow (`datasets.save_to_disk`): training reads windows
of seq_len + 1 tokens at any offset of one packed stream; Arrow stores a list of tokens per
document, so a window read would go through document offsets, while on a flat memmap it is a
slice. Pages come from the OS page cache, so resident memory does not grow with the corpus.

The same writer fills the on-the-fly cache of local files, so both paths give the same bytes.
"""

import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from titan.components.data.tokenizer import Tokenizer

FORMAT = "titan-token-shards"
VERSION = 1
META = "meta.json"


class ShardError(ValueError):
    pass


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Content hash of the tokenizer file and its BOS/EOS: equal fingerprints, equal tokens."""
    h = hashlib.sha256(tokenizer.path.read_bytes())
    h.update(f"|{tokenizer.bos_id}|{tokenizer.eos_id}".encode())
    return h.hexdigest()[:24]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def is_shard_folder(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file()


class ShardWriter:
    """Appends documents' tokens to shards of about `shard_tokens` tokens (cut between
    documents), in a temporary folder renamed into place by `close()`: a folder with a
    meta.json is always complete."""

    def __init__(
        self,
        out_dir: Path,
        tokenizer: Tokenizer,
        shard_tokens: int = 1 << 28,
        sources: list[str] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.tmp = self.out_dir.with_name(f".{self.out_dir.name}.{os.getpid()}.tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.shard_tokens = shard_tokens
        self.meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "tokenizer": {
                "fingerprint": tokenizer_fingerprint(tokenizer),
                "path": str(tokenizer.path),
                "vocab_size": tokenizer.vocab_size,
                "bos_id": tokenizer.bos_id,
                "eos_id": tokenizer.eos_id,
            },
            "sources": sources or [],
            "shards": [],
        }
        self._file = None

    def add(self, docs: Iterable[list[int]]) -> None:
        for ids in docs:
            if self._file is None:
                name = f"shard-{len(self.meta['shards']):05d}.bin"
                self._file = open(self.tmp / name, "wb")
                self.meta["shards"].append({"file": name, "tokens": 0, "documents": 0})
            self._file.write(np.asarray(ids, dtype=self.dtype).tobytes())
            shard = self.meta["shards"][-1]
            shard["tokens"] += len(ids)
            shard["documents"] += 1
            if shard["tokens"] >= self.shard_tokens:
                self._file.close()
                self._file = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.meta["shards"])

    def close(self) -> Path:
        """Finish the folder; when another process finished the same folder first, keep its."""
        if self._file is not None:
            self._file.close()
        (self.tmp / META).write_text(json.dumps(self.meta, indent=1) + "\n")
        try:
            os.replace(self.tmp, self.out_dir)
        except OSError:
            if not is_shard_folder(self.out_dir):
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.out_dir

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class TokenShards:
    """The concatenated token stream of a shard folder, read by slices through memmaps.

    Pickles as its path (a DataLoader worker maps the files itself, copying nothing)."""

    def __init__(self, folder: str | Path, tokenizer: Tokenizer | None = None):
        self.folder = Path(folder)
        self.meta = verify(self.folder, tokenizer)
        self.dtype = np.dtype(self.meta["dtype"])
        sizes = [int(s["tokens"]) for s in self.meta["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._maps = [self._map(s) for s in self.meta["shards"] if s["tokens"]]
        self._map_starts = self.starts[:-1][np.asarray(sizes) > 0]

    def _map(self, shard: dict) -> np.memmap:
        m = np.memmap(self.folder / shard["file"], dtype=self.dtype, mode="r")
        if hasattr(mmap, "MADV_RANDOM"):
            # windows are read at random offsets: readahead would map megabytes per window
            m._mmap.madvise(mmap.MADV_RANDOM)
        return m

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def documents(self) -> int:
        return sum(int(s["documents"]) for s in self.meta["shards"])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        i = int(np.searchsorted(self._map_starts, start, side="right")) - 1
        while filled < length:
            m, base = self._maps[i], int(self._map_starts[i])
            take = min(length - filled, len(m) - (pos - base))
            out[filled : filled + take] = m[pos - base : pos - base + take]
            filled, pos, i = filled + take, pos + take, i + 1
        return out

    def __getstate__(self):
        return {"folder": self.folder}

    def __setstate__(self, state):
        self.__init__(state["folder"])


class ArrayTokens:
    """An in-memory token stream with TokenShards' reading interface (tests, tiny corpora)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length].astype(np.int64)


def verify(folder: Path, tokenizer: Tokenizer | None = None) -> dict:
    """The folder's meta.json, once its shards have the sizes it records and (given a
    tokenizer) it was written by that tokenizer; ShardError naming the file otherwise. Reads
    the index and the files' sizes only, so the launcher checks a folder of any size."""
    meta = _read_meta(folder)
    if tokenizer is not None:
        theirs = meta["tokenizer"]
        if theirs["fingerprint"] != tokenizer_fingerprint(tokenizer):
            raise ShardError(
                f"token shards {folder} were written by the tokenizer {theirs['path']} "
                f"(fingerprint {theirs['fingerprint']}), not by {tokenizer.path} which this run "
                "uses: training on them would read the wrong tokens. Set model.tokenizer_path "
                "to the tokenizer that wrote them, or pretokenize again with this one"
            )
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        path = folder / shard["file"]
        want = int(shard["tokens"]) * itemsize
        have = path.stat().st_size if path.is_file() else -1
        if have != want:
            raise ShardError(
                f"token shard {path} is {'missing' if have < 0 else f'{have} bytes'}, but "
                f"{folder / META} says {want}: the folder is incomplete or was modified; "
                "write it again with scripts/pretokenize.py"
            )
    return meta


def _read_meta(folder: Path) -> dict:
    path = folder / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(
            f"{folder} is not a token-shard folder (no {META}); write one with "
            "scripts/pretokenize.py"
        ) from None
    except (OSError, ValueError) as e:
        raise ShardError(
            f"cannot read {path}: {e}; write the folder again with scripts/pretokenize.py"
        ) from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ShardError(
            f"{path} is not a {FORMAT} v{VERSION} index (format "
            f"{meta.get('format')!r}, version {meta.get('version')!r}); write the "
            "folder again with this titan's scripts/pretokenize.py"
        )
    return meta


def encode_documents(
    tokenizer: Tokenizer, batches: Iterable[list[str]], num_proc: int = 1
) -> Iterator[list[list[int]]]:
    """Each batch of texts as BOS ... EOS token lists, in order; `num_proc` > 1 tokenizes in
    that many processes."""
    if num_proc <= 1:
        for texts in batches:
            yield tokenizer.encode_batch(texts)
        return
    import multiprocessing as mp

    # forked workers inherit the tokenizer; its own thread pool must not be used across a fork
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with mp.get_context("fork").Pool(
        num_proc, initializer=_init_worker, initargs=(str(tokenizer.path),)
    ) as pool:
        yield from pool.imap(_encode, batches, chunksize=1)


_worker_tokenizer: Tokenizer | None = None


def _init_worker(path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(path)


def _encode(texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer.encode_batch(texts)
