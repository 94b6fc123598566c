"""Streamed sources (hub datasets, local files with `dataset_streaming`), packed on the fly.

Two orders:
- "rank": each dp rank reads its own shard of the stream (`split_dataset_by_node`). Cheap, but
  which sequences a step sees depends on the dp degree, and a resume must keep that degree.
- "global": every dp rank reads the whole stream, cuts the same windows, and keeps its slice
  of each global batch, as indexed sources do. A checkpoint resumes on any dp degree and the
  losses equal one process's; the price is that every rank reads and tokenizes all the text
  (dp times the work of "rank").
"""

import logging
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from titan.components.data import batch
from titan.components.data.dataset import DataError, DataShard, open_hub, open_local, text_column
from titan.components.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class StreamingPackedDataset(IterableDataset):
    """Infinite: every pass over the stream is an epoch. Finite (validation): one pass."""

    def __init__(
        self,
        name: str,
        files: list[Path] | None,
        tokenizer: Tokenizer,
        seq_len: int,
        shard: DataShard,
        text_field: str,
        infinite: bool = True,
        order: str = "rank",
        global_batch_size: int | None = None,
        key: str = "training.dataset",
    ):
        from datasets.distributed import split_dataset_by_node

        if files is None:
            ds, field = open_hub(name, key), text_field
        else:
            ds, fmt = open_local(files)
            field = text_column(ds, fmt, text_field, files[0])
        self.global_index = order == "global"
        if self.global_index:
            per_rank = global_batch_size // shard.dp_world_size
            self.slice = (shard.dp_rank * per_rank, (shard.dp_rank + 1) * per_rank)
            self.global_batch_size = global_batch_size
        else:
            ds = split_dataset_by_node(ds, rank=shard.dp_rank, world_size=shard.dp_world_size)
        self.ds = ds
        self.tokenizer, self.seq_len, self.text_field = tokenizer, seq_len, field
        self.infinite, self.name, self.files = infinite, name, files
        self.epoch, self.buffer, self.in_batch = 0, [], 0
        self._start = self.state_dict()

    def _windows(self):
        while True:
            self.ds.set_epoch(self.epoch)
            for sample in self._records():
                text = sample.get(self.text_field)
                if not isinstance(text, str):
                    raise DataError(
                        f"{self.name}: a record has no text in field '{self.text_field}' "
                        f"(fields: {sorted(sample)}); set training.dataset_text_field"
                    )
                self.buffer.extend(self.tokenizer.encode(text))
                while len(self.buffer) > self.seq_len:
                    window = torch.tensor(self.buffer[: self.seq_len + 1])
                    self.buffer = self.buffer[self.seq_len + 1 :]
                    yield batch.sample(window[:-1], window[1:])
            if not self.infinite:
                return
            self.epoch += 1
            logger.info("%s: stream exhausted, starting epoch %d", self.name, self.epoch)

    def _records(self):
        """The stream's records. A local file that fails to parse fails the same way after a
        restart: a DataError naming the files. A hub stream's errors may be the network's."""
        if self.files is None:
            yield from self.ds
            return
        records = iter(self.ds)
        while True:
            try:
                sample = next(records)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001  datasets/pyarrow raise many types
                names = ", ".join(str(f) for f in self.files[:3])
                more = f" (and {len(self.files) - 3} more)" if len(self.files) > 3 else ""
                raise DataError(
                    f"{names}{more}: a record is unreadable ({type(e).__name__}: "
                    f"{e}); fix or remove the file"
                ) from None
            yield sample

    def __iter__(self):
        if not self.global_index:
            yield from self._windows()
            return
        lo, hi = self.slice
        held = None
        for window in self._windows():
            i = self.in_batch
            self.in_batch = (i + 1) % self.global_batch_size
            if held is not None and self.in_batch == 0:
                # the slice's last sample waits until the whole batch is read, so the saved
                # position is the batch boundary: the same on every rank
                yield held
                held = None
            if lo <= i < hi - 1:
                yield window
            elif i == hi - 1:
                if self.in_batch == 0:
                    yield window
                else:
                    held = window

    def state_dict(self) -> dict:
        if self.global_index and self.in_batch:
            raise DataError(
                f"{self.name}: the stream position is saved between global "
                f"batches only ({self.in_batch} windows into one)"
            )
        return {"ds": self.ds.state_dict(), "buffer": list(self.buffer), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.ds.load_state_dict(state["ds"])
        self.buffer, self.epoch, self.in_batch = list(state["buffer"]), int(state["epoch"]), 0

    def rewind(self) -> None:
        self.load_state_dict(self._start)
