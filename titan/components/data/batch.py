"""A batch is a mapping of named tensors, each (batch, seq): the tokens (`input_ids`), their
targets (`labels`, IGNORE_INDEX where the loss does not count), and whatever else the data
says of them (a chat window's document ids, a plugin dataset's loss weights or positions).

Datasets yield one sample as such a mapping and the dataloader stacks them by name. Fields
beyond the tokens and the labels reach the model as keyword arguments when its family lists
them in `batch_fields`; the objective's terms may read any of them.
"""

import torch

INPUT_IDS = "input_ids"
LABELS = "labels"

Batch = dict[str, torch.Tensor]


def sample(input_ids: torch.Tensor, labels: torch.Tensor, **fields: torch.Tensor) -> Batch:
    return {INPUT_IDS: input_ids, LABELS: labels, **fields}


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {name: t.to(device) for name, t in batch.items()}


def extra_fields(batch: Batch) -> Batch:
    """The fields beside the tokens and the labels."""
    return {k: v for k, v in batch.items() if k not in (INPUT_IDS, LABELS)}


def collate(samples: list[Batch]) -> Batch:
    """Samples stacked by name; a row field whose rows differ in length (a row's images'
    patches) padded with zeros to the longest (a grid of zeros is no image)."""
    out = {}
    for name in samples[0]:
        rows = [s[name] for s in samples]
        longest = max(r.shape[0] for r in rows)
        if any(r.shape[0] != longest for r in rows):
            rows = [torch.cat([r, r.new_zeros(longest - r.shape[0], *r.shape[1:])]) for r in rows]
        out[name] = torch.stack(rows)
    return out
