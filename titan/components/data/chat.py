"""Chat data for supervised fine-tuning: conversations rendered with the model's chat
template into windows of `seq_len` tokens, labels only where the loss counts (the assistant's
tokens; elsewhere IGNORE_INDEX) and each token's conversation, so a packed window's
conversations never see each other.

A conversation of n tokens takes n places of a window: its inputs are its tokens, its labels
the next ones, and its last place predicts nothing. Packing fills windows in the data's
order and starts a new window where the next conversation does not fit; padding gives each
conversation its own window. Windows are then read in `GlobalOrder`, as packed text is.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titan.components.data.batch import Batch, sample
from titan.components.data.chat_template import ChatTemplate
from titan.components.data.dataset import (
    DataError,
    check_messages,
    iter_column,
    open_hub,
    with_progress,
)
from titan.components.training.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatOptions:
    seq_len: int
    messages_field: str = "messages"
    last_only: bool = False
    pack: bool = True
    truncate: bool = True


@dataclass
class ChatCounts:
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    counted: int = 0


def _message_batches(source: list[Path] | str, field: str):
    """The conversations of local files, or of a hub dataset (read whole, as a stream)."""
    key = "chat.messages_field"
    if not isinstance(source, str):
        yield from iter_column(source, field, check_messages, key, batch_size=256)
        return
    ds = open_hub(source)
    if ds.column_names is not None and field not in ds.column_names:
        raise DataError(f"dataset {source} has no column '{field}' ({ds.column_names}); set {key}")
    for n, row in enumerate(ds):
        check_messages(row.get(field), f"{source}: record {n + 1}", field)
        yield [row[field]]


def encode_conversations(source: list[Path] | str, template: ChatTemplate, opts: ChatOptions):
    """(ids, labels) int32 arrays per conversation in the data's order, cut to fit a window
    (or left out: `opts.truncate`); and their counts. `source`: local files or a hub name."""
    counts, out = ChatCounts(), []
    batches = with_progress(
        _message_batches(source, opts.messages_field),
        lambda s: f"rendering chat data: {counts.conversations} conversations so far ({s:.0f}s)",
    )
    for batch in batches:
        for messages in batch:
            counts.conversations += 1
            try:
                ids, counted = template.encode(messages, last_only=opts.last_only)
            except DataError as e:
                where = source if isinstance(source, str) else ", ".join(map(str, source))
                raise DataError(
                    f"{where}: conversation {counts.conversations} (counted from 1, from the "
                    f"first file's first record): {e}; fix the template or drop that record"
                ) from None
            ids, counted = np.asarray(ids, np.int32), np.asarray(counted, bool)
            labels = np.full(len(ids), IGNORE_INDEX, np.int32)
            labels[:-1] = np.where(counted[1:], ids[1:], IGNORE_INDEX)
            if len(ids) > opts.seq_len:
                if not opts.truncate:
                    counts.dropped += 1
                    continue
                counts.truncated += 1
                ids, labels = ids[: opts.seq_len], labels[: opts.seq_len]
            counts.tokens += len(ids)
            counts.counted += int((labels != IGNORE_INDEX).sum())
            out.append((ids, labels))
    return out, counts


class ChatWindows(Dataset):
    """Window i: input_ids, labels and doc_ids (the conversation of each token), each
    (seq_len,)."""

    def __init__(self, conversations, seq_len: int, pad_id: int, pack: bool, name: str):
        self.seq_len, self.name = seq_len, name
        windows, fill = [], seq_len  # `fill`: the open window's tokens so far
        for ids, labels in conversations:
            if not pack or fill + len(ids) > seq_len:
                windows.append([])
                fill = 0
            windows[-1].append((ids, labels))
            fill += len(ids)
        if not windows:
            raise DataError(f"{name} holds no conversation that fits training.seq_len")
        self.inputs = np.full((len(windows), seq_len), pad_id, np.int32)
        self.labels = np.full((len(windows), seq_len), IGNORE_INDEX, np.int32)
        self.docs = np.zeros((len(windows), seq_len), np.int32)
        for w, convs in enumerate(windows):
            at = 0
            for doc, (ids, labels) in enumerate(convs):
                self.inputs[w, at : at + len(ids)] = ids
                self.labels[w, at : at + len(ids)] = labels
                self.docs[w, at : at + len(ids)] = doc
                at += len(ids)
            self.docs[w, at:] = len(convs)  # the padding: a document of its own

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> Batch:
        return sample(
            torch.from_numpy(self.inputs[i].astype(np.int64)),
            torch.from_numpy(self.labels[i].astype(np.int64)),
            doc_ids=torch.from_numpy(self.docs[i].copy()),
        )


def chat_windows(
    source: list[Path] | str, template: ChatTemplate, opts: ChatOptions, pad_id: int, name: str
) -> ChatWindows:
    conversations, counts = encode_conversations(source, template, opts)
    windows = ChatWindows(conversations, opts.seq_len, pad_id, opts.pack, name)
    if counts.counted == 0:
        raise DataError(
            f"{name}: no token the loss counts is left in any conversation (the loss counts "
            "only assistant replies)"
            + (
                f": training.seq_len {opts.seq_len} cuts off every reply ({counts.truncated} of "
                f"{counts.conversations} conversations are longer); raise training.seq_len"
                if counts.truncated
                else "; the data holds no assistant turn"
            )
        )
    logger.info(
        "chat data %s: %d conversations in %d windows of %d tokens (%s), %.1f%% of the "
        "places filled, %.1f%% of tokens counted by the loss; %d longer than seq_len %s",
        name,
        counts.conversations - counts.dropped,
        len(windows),
        opts.seq_len,
        "packed" if opts.pack else "padded",
        100 * counts.tokens / (len(windows) * opts.seq_len),
        100 * counts.counted / max(counts.tokens, 1),
        counts.truncated + counts.dropped,
        "dropped" if counts.dropped else "truncated",
    )
    return windows
