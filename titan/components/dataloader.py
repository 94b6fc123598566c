"""Checkpointable dataloaders over the packed datasets."""

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from titan.components.dataset import DataShard, build_dataset
from titan.components.tokenizer import Tokenizer

__all__ = ["DataShard", "build_dataloader", "build_text_dataloader"]


def build_text_dataloader(*, dataset: str, dataset_path: str | None, tokenizer: Tokenizer,
                          seq_len: int, local_batch_size: int, global_batch_size: int,
                          shard: DataShard, seed: int, text_field: str = "text",
                          shuffle: bool = True, infinite: bool = True,
                          streaming: bool = False) -> StatefulDataLoader:
    """Batches of (input, label), each (local_batch_size, seq_len) int64.

    Its state_dict() holds the dataset position, so a restored loader yields exactly the
    batch an uninterrupted one would have yielded next.
    """
    ds = build_dataset(dataset=dataset, dataset_path=dataset_path, tokenizer=tokenizer,
                       seq_len=seq_len, shard=shard, global_batch_size=global_batch_size,
                       seed=seed, text_field=text_field, shuffle=shuffle, infinite=infinite,
                       streaming=streaming)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own call
        return StatefulDataLoader(ds, batch_size=local_batch_size, num_workers=0)


def build_dataloader(cfg, *, tokenizer: Tokenizer, shard: DataShard,
                     global_batch_size: int) -> StatefulDataLoader:
    """The training loader of `cfg` (the training section): infinite, shuffled per epoch."""
    return build_text_dataloader(
        dataset=cfg.dataset, dataset_path=cfg.dataset_path, tokenizer=tokenizer,
        seq_len=cfg.seq_len, local_batch_size=cfg.local_batch_size,
        global_batch_size=global_batch_size, shard=shard, seed=cfg.seed,
        text_field=cfg.dataset_text_field, shuffle=cfg.dataset_shuffle,
        streaming=cfg.dataset_streaming)
