"""Checkpointable dataloaders: batches of (input, label), each (local_batch_size, seq_len).

Indexed sources are read by torchdata's StatefulDataLoader over a map-style dataset, with
`num_workers` processes fetching windows ahead. The saved position is not the loader's own
state but the samples the trainer has taken, as a count of global batches: batches a worker
fetched ahead are fetched again after a resume, and a checkpoint resumes on any dp degree and
any worker count. Streamed sources are read in the main process.
"""

import logging
import warnings
from dataclasses import dataclass

import numpy as np
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titan.components.data.batch import INPUT_IDS, collate
from titan.components.data.chat import ChatOptions, chat_windows
from titan.components.data.chat_template import ChatTemplate
from titan.components.data.data_order import GlobalOrder
from titan.components.data.dataset import (
    DataError,
    DataShard,
    check_same_fields,
    local_files,
    parse_mix,
    sample_fields,
)
from titan.components.data.document_index import DocSpan, read_skip_file
from titan.components.data.packed import MixedWindows, PackedWindows, open_tokens, with_fields
from titan.components.data.streaming import StreamingPackedDataset
from titan.components.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["DataShard", "build_dataloader", "build_text_dataloader"]


@dataclass(frozen=True)
class Workers:
    num_workers: int = 0
    prefetch_factor: int = 2


def _loader(dataset, batch_size: int, workers: Workers, sampler=None) -> StatefulDataLoader:
    extra = (
        {"prefetch_factor": workers.prefetch_factor, "multiprocessing_context": "fork"}
        if workers.num_workers
        else {}
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own call
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate,
            num_workers=workers.num_workers,
            **extra,
        )


class IndexedLoader:
    """Packed windows in `GlobalOrder`; its position is the samples the trainer took."""

    global_index = True  # its state is the same on every rank, for any dp degree

    def __init__(
        self, windows: MixedWindows, order: GlobalOrder, local_batch_size: int, workers: Workers
    ):
        self.windows, self.order = windows, order
        self.local_batch_size, self.workers = local_batch_size, workers
        self.taken = 0  # samples this rank's trainer has taken since first_batch
        self.first_batch = 0  # the global batches taken before (by the run resumed here)
        self._generation = 0  # bumped by every jump: a running iterator restarts there

    def __iter__(self):
        while True:
            generation = self._generation
            self.order.start = self.taken
            batches = iter(
                _loader(self.windows, self.local_batch_size, self.workers, sampler=self.order)
            )
            # a jump (or a resize) between two batches: the old iterator is not asked again
            # (its sampler would read the order as it is now)
            while generation == self._generation:
                batch = next(batches, None)
                if batch is None:
                    return  # a finite pass ended
                self.taken += batch[INPUT_IDS].shape[0]
                yield batch

    def state_dict(self) -> dict:
        """`global_batches`: the steps' batches taken, counted from the first run's start;
        `stream_position`: where the next one starts in the global stream (its counts per
        source: `source_counts`), whatever the global batch size was on the way."""
        batches, offset = divmod(self.taken, self.order.per_rank)
        return {
            "global_batches": self.first_batch + batches,
            "offset": offset,
            "stream_position": self.order.origin + batches * self.order.global_batch_size,
            "global_batch_size": self.order.global_batch_size,
            "source_counts": self.order.counts_at(batches).tolist(),
            "seq_len": self.windows.sources[0].seq_len,
            "sources": list(self.order.names),
            "source_windows": [int(n) for n in self.order.sizes],
        }

    def step_documents(self) -> list[DocSpan] | None:
        """The documents of the global batch last taken (every rank's samples), a span of
        labels each; None where they cannot be named (a source not of packed text)."""
        batches, offset = divmod(self.taken, self.order.per_rank)
        sources = self.windows.sources
        if offset or not batches or not all(getattr(s, "bos", None) is not None for s in sources):
            return None
        spans, n = [], self.order.pieces
        for i, (s, w) in enumerate(self.order.batch_windows(batches - 1)):
            window_docs = sources[s].label_documents(w)
            for piece, docs in enumerate(np.split(window_docs, n)):  # a piece a sample
                bounds = [0, *(np.flatnonzero(np.diff(docs)) + 1).tolist(), len(docs)]
                for first, end in zip(bounds[:-1], bounds[1:]):
                    name = self.order.names[s]
                    spans.append(DocSpan(i * n + piece, name, int(docs[first]), first, end))
        return spans

    def source_tokens(self, seq_len: int) -> dict[str, int] | None:
        """Tokens drawn from each source by the global batches taken so far (all ranks);
        None for a single source."""
        if len(self.order.sizes) == 1:
            return None
        counts = self.order.counts_at(self.taken // self.order.per_rank)
        return {name: int(c) * seq_len for name, c in zip(self.order.names, counts)}

    def load_state_dict(self, state: dict) -> None:
        batches, offset = int(state["global_batches"]), int(state["offset"])
        size = self.order.global_batch_size
        if "source_counts" not in state:  # an early checkpoint: replayed, at the same size
            self.first_batch = 0
            self._jump(batches * self.order.per_rank + offset)
            return
        saved_size = int(state.get("global_batch_size", size))  # absent: not recorded, same
        position = int(state.get("stream_position", batches * size))
        if saved_size != size:
            if offset:
                raise DataError(
                    f"the checkpoint stopped {offset} samples into a global batch of {saved_size}"
                    f" sequences, which a global batch of {size} cannot continue: resume with "
                    f"training.global_batch_size = {saved_size}"
                )
            logger.info(
                "the data continues at sequence %d of the global stream, the first "
                "not yet trained: the global batch changed from %d to %d sequences, "
                "none is skipped or repeated",
                position,
                saved_size,
                size,
            )
        saved_seq, seq = state.get("seq_len"), self.windows.sources[0].seq_len
        if saved_seq is not None and saved_seq != seq:
            # a long-context phase: no window of the new length is one of the old ones
            logger.info(
                "training.seq_len changed from %d to %d: the corpus is cut into windows of %d "
                "tokens, and the data continues at sequence %d of their shuffled order (the "
                "new windows overlap tokens trained at %d: a change of window has no exact "
                "continuation)",
                saved_seq,
                seq,
                seq,
                position,
                saved_seq,
            )
        counts = state.get("source_counts")
        if state.get("sources") is not None and state["sources"] != list(self.order.names):
            position, counts, offset = self._other_sources(state)
        else:
            self._say_if_resized(state)
        self.first_batch = batches
        self.order.start_at(position, counts)
        self._jump(offset)

    def _other_sources(self, state: dict) -> tuple[int, list[int], int]:
        """The data is not the checkpoint's: each source it also read continues where it
        stopped, a new one starts at its beginning. Returns (position, counts, offset)."""
        saved = dict(zip(state["sources"], state["source_counts"]))
        counts = [int(saved.get(name, 0)) for name in self.order.names]
        kept = [n for n in self.order.names if n in saved]
        new = [n for n in self.order.names if n not in saved]
        logger.warning(
            "the data is not what the checkpoint trained on (%s then, %s now): %s",
            "+".join(state["sources"]),
            "+".join(self.order.names),
            "; ".join(
                part
                for part in (
                    f"{', '.join(new)} start(s) at the beginning" if new else "",
                    f"{', '.join(kept)} continue(s) where the checkpoint stopped" if kept else "",
                )
                if part
            ),
        )
        return sum(counts), counts, 0

    def _say_if_resized(self, state: dict) -> None:
        for name, was, now in zip(
            state.get("sources") or [], state.get("source_windows") or [], self.order.sizes
        ):
            if was != now:
                logger.warning(
                    "%s holds %d windows now and held %d when the checkpoint was saved: its "
                    "files changed, so the data continues at the checkpoint's place in a new "
                    "order",
                    name,
                    now,
                    was,
                )

    def rewind(self) -> None:
        self.first_batch = 0
        self.order.start_at(0, [0] * len(self.order.sizes))
        self._jump(0)

    def resize(
        self, global_batch_size: int, pieces: int = 1, local_batch_size: int | None = None
    ) -> None:
        """Global batches of `global_batch_size` windows from the next one on, each window cut
        into `pieces` sequences, `local_batch_size` of them a batch (the run's schedules: a
        step's shape): the stream continues at its first window not yet taken, so its windows
        are trained in the order a run of these shapes from the start trains them."""
        local = local_batch_size or self.local_batch_size
        order = self.order
        if (global_batch_size, pieces, local) == (
            order.global_batch_size,
            order.pieces,
            self.local_batch_size,
        ):
            return
        batches, offset = divmod(self.taken, order.per_rank)
        if offset:
            raise DataError(
                f"a global batch cannot change shape {offset} samples into a batch of "
                f"{order.global_batch_size} windows"
            )
        position = order.origin + batches * order.global_batch_size
        counts = order.counts_at(batches).tolist()
        order.resize(global_batch_size, pieces)
        self.local_batch_size = local
        self.first_batch += batches
        order.start_at(position, counts)
        self._jump(0)

    def seek_global_batch(self, batches: int) -> None:
        """Continue at the start of global batch `batches` (a torchft heal jumps steps)."""
        self._jump((batches - self.first_batch) * self.order.per_rank)

    def _jump(self, taken: int) -> None:
        self.taken = taken
        self._generation += 1


class _Fields(IterableDataset):
    """A stream's samples with its dataset's batch fields added."""

    def __init__(self, dataset: IterableDataset, fields):
        self.dataset, self.fields = dataset, fields

    def __iter__(self):
        for sample in self.dataset:
            yield with_fields(sample, self.fields)


class StreamLoader:
    """A streamed source; its state is the stream's (per dp rank, or global)."""

    def __init__(self, dataset: StreamingPackedDataset, local_batch_size: int, fields=None):
        self.dataset = dataset
        self.global_index = dataset.global_index
        source = dataset if fields is None else _Fields(dataset, fields)
        self._loader = _loader(source, local_batch_size, Workers())

    def __iter__(self):
        return iter(self._loader)

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)

    def rewind(self) -> None:
        self.dataset.rewind()

    def step_documents(self) -> None:
        return None  # a stream knows no document indices

    def source_tokens(self, seq_len: int) -> None:
        return None  # one source

    def seek_global_batch(self, batches: int) -> None:
        raise DataError(
            f"{self.dataset.name} is streamed: it has no global index to seek to "
            f"batch {batches}; use a local dataset without dataset_streaming"
        )

    def resize(self, global_batch_size: int, pieces: int = 1, local_batch_size=None) -> None:
        raise DataError(
            f"{self.dataset.name} is streamed: its batches cannot change size "
            f"(training.global_batch_schedule); use a local dataset without dataset_streaming"
        )


def _packed(sources, files, tokenizer, text_field: str, seq_len: int, skip_documents: str):
    """Each source's documents packed into windows, read indexed, less skip_documents'."""
    windows = [
        PackedWindows(open_tokens(f, tokenizer, text_field), seq_len, name, tokenizer.bos_id)
        for (name, _), f in zip(sources, files)
    ]
    if skip_documents:
        skipped = read_skip_file(skip_documents, {w.name: (w.tokens, w.bos) for w in windows})
        for w in windows:
            w.skip(skipped.get(w.name, []))
        logger.info(
            "leaving out %s (training.skip_documents)",
            ", ".join(f"{len(d)} document(s) of {n}" for n, d in skipped.items()) or "nothing",
        )
    return windows


def build_text_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    shard: DataShard,
    seed: int,
    text_field: str = "text",
    shuffle: bool = True,
    infinite: bool = True,
    streaming: bool = False,
    stream_order: str = "rank",
    workers: Workers = Workers(),
    mix: list[tuple[str, float]] | None = None,
    section: str = "training",
    skip_documents: str = "",
):
    """A restored loader yields exactly the batch an uninterrupted one would have yielded.
    `mix`: (source, weight) pairs read instead of dataset/dataset_path. `section`: the config
    section whose dataset this is, for the errors that name its keys."""
    sources = mix or [(dataset, 1.0)]
    check_same_fields([name for name, _ in sources])
    fields = sample_fields(sources[0][0], tokenizer)
    files = [
        local_files(
            name,
            dataset_path if not mix else None,
            key="training.dataset_mix" if mix else f"{section}.dataset_path",
        )
        for name, _ in sources
    ]
    # what the data's plan checks refused is not checked again here (titan.components.data
    # .checks: a stream of token shards, documents skipped from a stream, a mix of hub sources)
    if not mix and (files[0] is None or streaming):
        ds = StreamingPackedDataset(
            dataset,
            files[0],
            tokenizer,
            seq_len,
            shard,
            text_field,
            infinite,
            order=stream_order,
            global_batch_size=global_batch_size,
            key=f"{section}.dataset",
        )
        return StreamLoader(ds, local_batch_size, fields)
    windows = _packed(sources, files, tokenizer, text_field, seq_len, skip_documents)
    return _indexed(
        windows,
        sources,
        local_batch_size=local_batch_size,
        global_batch_size=global_batch_size,
        shard=shard,
        seed=seed,
        shuffle=shuffle,
        infinite=infinite,
        workers=workers,
        fields=fields,
    )


def _indexed(
    windows: list,
    sources: list[tuple[str, float]],
    *,
    local_batch_size: int,
    global_batch_size: int,
    shard: DataShard,
    seed: int,
    shuffle: bool = True,
    infinite: bool = True,
    workers: Workers = Workers(),
    fields=None,
):
    """Indexed sources' windows (one list each; `sources`: their (name, weight)) read in a
    global order: resumes exactly, on any dp degree."""
    order = GlobalOrder(
        [len(w) for w in windows],
        [weight for _, weight in sources],
        dp_rank=shard.dp_rank,
        dp_world_size=shard.dp_world_size,
        global_batch_size=global_batch_size,
        seed=seed,
        shuffle=shuffle,
        infinite=infinite,
        names=[name for name, _ in sources],
    )
    return IndexedLoader(MixedWindows(windows, fields), order, local_batch_size, workers)


def build_chat_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    chat,
    seq_len: int,
    section: str = "training",
    **reading,
):
    """Conversations (`chat`: the chat section) as windows of (inputs, labels, doc_ids),
    read in a global order as packed text is: resumes exactly, on any dp degree. `reading`:
    what `_indexed` takes (batch sizes, shard, seed, order, workers)."""
    template = ChatTemplate.load(tokenizer, chat.template)
    opts = ChatOptions(
        seq_len=seq_len,
        messages_field=chat.messages_field,
        last_only=chat.loss_on == "last_assistant",
        pack=chat.packing == "pack",
        truncate=chat.overlong == "truncate",
    )
    files = local_files(dataset, dataset_path, key=f"{section}.dataset_path")
    windows = chat_windows(files or dataset, template, opts, tokenizer.pad_id, dataset)
    fields = sample_fields(dataset, tokenizer)
    return _indexed([windows], [(dataset, 1.0)], fields=fields, **reading)


def build_image_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    images,
    vision,
    seq_len: int,
    text_field: str = "text",
    section: str = "training",
    chat=None,
    **reading,
):
    """Image-text records (`images`: the images section; `vision`: the model's VisionArgs,
    whose patches the processor's rule makes; `chat`: the chat section, whose template and
    messages field image conversations use) as packed windows with their images; `reading`:
    what `_indexed` takes (batch sizes, shard, seed, order, workers)."""
    from titan.components.data.image_sources import open_image_source
    from titan.components.data.image_text import image_rule, image_text_windows

    rule = image_rule(vision, images)
    key = f"{section}.dataset_path"
    messages = chat.messages_field if chat is not None else "messages"
    source = open_image_source(dataset, dataset_path, images.image_field, text_field, key, messages)
    template = chat.template if chat is not None else ""
    windows = image_text_windows(source, rule, tokenizer, seq_len, dataset, template)
    return _indexed([windows], [(dataset, 1.0)], **reading)


def build_dataloader(
    cfg,
    *,
    tokenizer: Tokenizer,
    shard: DataShard,
    global_batch_size: int,
    sections: dict,
    model_args=None,
):
    """The training loader of `cfg` (the training section; `sections`: the job's registered
    sections, of which the data format's own, [chat] or [images], is read; `model_args`: the
    model's, whose vision tower image data are cut for): infinite, shuffled per epoch."""
    common = dict(
        dataset=cfg.dataset,
        dataset_path=cfg.dataset_path,
        tokenizer=tokenizer,
        seq_len=cfg.seq_len,
        local_batch_size=cfg.local_batch_size,
        global_batch_size=global_batch_size,
        shard=shard,
        seed=cfg.seed,
        shuffle=cfg.dataset_shuffle,
        workers=Workers(cfg.dataloader_num_workers, cfg.dataloader_prefetch_factor),
    )
    if cfg.dataset_format == "chat":
        return build_chat_dataloader(**common, chat=sections["chat"])
    if cfg.dataset_format == "images":
        return build_image_dataloader(
            **common,
            images=sections["images"],
            vision=model_args.vision,
            chat=sections["chat"],
            text_field=cfg.dataset_text_field,
        )
    return build_text_dataloader(
        **common,
        text_field=cfg.dataset_text_field,
        streaming=cfg.dataset_streaming,
        stream_order=cfg.dataset_stream_order,
        mix=parse_mix(cfg.dataset_mix) if cfg.dataset_mix else None,
        skip_documents=cfg.skip_documents,
    )
