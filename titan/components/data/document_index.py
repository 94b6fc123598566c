"""Documents of a packed token stream, by their index in it (0 = the source's first, in corpus
order): each opens with BOS, so a document's index is the count of BOS tokens before it. What
names a step's documents (stability.rerun_on_spike) and what leaves documents out of training
(training.skip_documents, whose entries are lines of JSON as spikes.jsonl names them:
{"dataset": ..., "document": ...}).

A token-shard folder records each shard's document count, so a lookup reads one shard at most."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan.components.data.dataset import DataError

# tokens read at a time when counting BOS through a shard
_CHUNK = 1 << 24


@dataclass(frozen=True)
class DocSpan:
    """A document's labels in one sample of a global batch: labels [first, end) of sample
    `sample` (its position in the global batch) predict tokens of document `document` of
    source `dataset`."""

    sample: int
    dataset: str
    document: int
    first: int
    end: int

    def entry(self) -> dict:
        return {"dataset": self.dataset, "document": self.document}


def _shards(tokens) -> list[tuple[int, int, int]]:
    """(first token, tokens, documents before it) of each shard; one for an in-memory array."""
    meta = getattr(tokens, "meta", None)
    if meta is None:
        return [(0, len(tokens), 0)]
    out, docs = [], 0
    for start, shard in zip(tokens.starts, meta["shards"]):
        out.append((int(start), int(shard["tokens"]), docs))
        docs += int(shard["documents"])
    return out


def _count_bos(tokens, start: int, end: int, bos: int) -> int:
    n = 0
    for lo in range(start, end, _CHUNK):
        n += int(np.count_nonzero(tokens.read(lo, min(_CHUNK, end - lo)) == bos))
    return n


def bos_before(tokens, pos: int, bos: int) -> int:
    """BOS tokens in [0, pos): the index of the document that token `pos` opens or continues
    is this (or this - 1 when it is not itself a BOS)."""
    first, _, docs = [s for s in _shards(tokens) if s[0] <= pos][-1]
    return docs + _count_bos(tokens, first, pos, bos)


def label_documents(tokens, start: int, length: int, bos: int) -> np.ndarray:
    """The document of each of a window's `length` labels: label j predicts token
    start + j + 1 and belongs to that token's document."""
    predicted = tokens.read(start + 1, length)
    before = bos_before(tokens, start + 1, bos)
    return before - 1 + np.cumsum(predicted == bos)


def documents_in(tokens, bos: int) -> int:
    meta = getattr(tokens, "meta", None)
    if meta is not None:
        return sum(int(s["documents"]) for s in meta["shards"])
    return _count_bos(tokens, 0, len(tokens), bos)


def document_range(tokens, document: int, bos: int) -> tuple[int, int]:
    """[first token, end) of a document in the stream."""
    shards = _shards(tokens)
    first, size, docs = [s for s in shards if s[2] <= document][-1]
    opens = _bos_positions(tokens, first, first + size, bos, stop_after=document - docs + 2)
    start = opens[document - docs]
    end = opens[document - docs + 1] if len(opens) > document - docs + 1 else first + size
    return start, end


def _bos_positions(tokens, start: int, end: int, bos: int, stop_after: int) -> list[int]:
    found: list[int] = []
    for lo in range(start, end, _CHUNK):
        chunk = tokens.read(lo, min(_CHUNK, end - lo))
        found.extend(int(lo + i) for i in np.flatnonzero(chunk == bos))
        if len(found) >= stop_after:
            break
    return found


def skip_refusal(chat: bool, streamed: bool, value: str) -> str | None:
    """Why training.skip_documents = value cannot apply to this data, or None."""
    if chat:
        return (
            "training.skip_documents leaves out documents of packed text; chat data "
            "(training.dataset_format = chat) is not read that way: unset it"
        )
    if streamed:
        return (
            f"training.skip_documents = {value!r} needs an indexed source (a local file, "
            "folder or token shards, not streamed); unset training.dataset_streaming or "
            "pretokenize the dataset (scripts/pretokenize.py)"
        )
    return None


def parse_skip_file(path: str, names: list[str], key: str = "training.skip_documents") -> dict:
    """The documents to leave out, by source name: {name: sorted indices}, each line of the
    file well formed and naming a source of `names` (the indices are checked against the
    sources by read_skip_file)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"{key} = {path!r}: no such file (lines of JSON as spikes.jsonl names them)"
        )
    out: dict[str, set[int]] = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            name, doc = entry["dataset"], entry["document"]
        except (ValueError, KeyError, TypeError):
            raise DataError(
                f'{key}: line {n} of {path} is not {{"dataset": ..., "document": ...}}'
            ) from None
        if name not in names:
            raise DataError(
                f"{key}: line {n} of {path} names dataset {name!r}, which this run does not "
                f"read (it reads {', '.join(names)})"
            )
        if not isinstance(doc, int) or doc < 0:
            raise DataError(f"{key}: line {n} of {path}: document {doc!r} is not an index")
        out.setdefault(name, set()).add(doc)
    return {name: sorted(docs) for name, docs in out.items()}


def read_skip_file(path: str, sources: dict, key: str = "training.skip_documents") -> dict:
    """parse_skip_file's documents, each within its source. `sources`: each source's name ->
    its (tokens, bos)."""
    skipped = parse_skip_file(path, list(sources), key)
    for name, docs in skipped.items():
        total = documents_in(*sources[name])
        if docs[-1] >= total:
            raise DataError(
                f"{key}: {path} names document {docs[-1]} of {name!r}, which holds "
                f"documents 0 to {total - 1}"
            )
    return skipped
