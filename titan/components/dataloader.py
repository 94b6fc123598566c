"""A checkpointable dataloader over the packed datasets."""

import warnings
from dataclasses import dataclass

from torchdata.stateful_dataloader import StatefulDataLoader

from titan.components.dataset import build_dataset
from titan.components.tokenizer import Tokenizer


@dataclass(frozen=True)
class DataShard:
    """Which slice of each global batch this rank reads."""

    dp_rank: int = 0
    dp_world_size: int = 1


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer: Tokenizer, seq_len: int,
                     local_batch_size: int, global_batch_size: int, shard: DataShard, seed: int,
                     text_field: str = "text", shuffle: bool = True,
                     infinite: bool = True) -> StatefulDataLoader:
    """Batches of (input, label), each (local_batch_size, seq_len) int64.

    Its state_dict() holds the dataset position, so a restored loader yields exactly the
    batch an uninterrupted one would have yielded next.
    """
    ds = build_dataset(dataset, dataset_path, tokenizer, seq_len, shard.dp_rank,
                       shard.dp_world_size, global_batch_size, seed, text_field=text_field,
                       shuffle=shuffle, infinite=infinite)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own call
        return StatefulDataLoader(ds, batch_size=local_batch_size, num_workers=0)
