"""Cross-entropy (and the objective's terms on the logits, a z-loss) over chunks of tokens, so
that the logits of a long sequence never exist whole (`training.loss_chunk_tokens`).

The output layer becomes a `ChunkedLossOutput`: the same weight (and tie, and state-dict name),
but given the labels it returns the summed cross-entropy instead of the logits. Each chunk's
logits are made, reduced to their loss and dropped; backward makes them again, one chunk at a
time (activation checkpointing of the chunk), so the step holds one chunk's logits where it
held the whole sequence's, for one more output-layer matmul per chunk. The loss runs inside the
model's forward, where FSDP holds the weight unsharded. Without labels (validation, generation,
a family's extra heads) it is the plain linear layer.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan.components.converters import Converter
from titan.components.training.loss import cross_entropy_sum


def _chunk_loss(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, terms: tuple
) -> torch.Tensor:
    # (1, tokens, ...): cross_entropy_sum's (batch, seq) form, its float32 upcast included
    logits, labels = F.linear(h, weight)[None], labels[None]
    ce = cross_entropy_sum(logits, labels)
    return torch.stack([ce, *(term.token_sum(logits, labels).float() for term in terms)])


class ChunkedLossOutput(nn.Linear):
    """An output projection that, given `labels`, returns the sums [cross-entropy, each
    objective term on the logits (a z-loss), in the objective's order] of its logits,
    computed `chunk_tokens` tokens at a time (the objective composes them: its
    `output_sums`)."""

    takes_labels = True

    def __init__(self, linear: nn.Linear, chunk_tokens: int, terms: tuple = ()):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight  # the same parameter: ties and checkpoints are untouched
        self.chunk_tokens, self.terms = chunk_tokens, tuple(terms)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        h, labels = h.flatten(0, 1), labels.flatten(0, 1)
        total = None
        for start in range(0, h.shape[0], self.chunk_tokens):
            part = slice(start, start + self.chunk_tokens)
            loss = checkpoint(
                _chunk_loss, h[part], self.weight, labels[part], self.terms, use_reentrant=False
            )
            total = loss if total is None else total + loss
        return total


def apply_chunked_loss(model: nn.Module, chunk_tokens: int, terms: tuple = ()) -> None:
    """Replace `model.output` (an nn.Linear without bias, on any device) by a
    ChunkedLossOutput of `chunk_tokens` tokens per chunk computing `terms` too, over the
    same weight, so ties and checkpoints are untouched."""
    output = model.output
    if type(output) is not nn.Linear or output.bias is not None:
        raise TypeError(
            f"training.loss_chunk_tokens needs a plain nn.Linear output without bias, got {output}"
        )
    model.output = ChunkedLossOutput(output, chunk_tokens, terms)


class ChunkedLossConverter(Converter):
    """The converter entry: the output layer computes the loss, `loss_chunk_tokens` at a time."""

    def __init__(self, job):
        from titan.components.training.terms import build_terms

        self.chunk_tokens = job.training.loss_chunk_tokens
        # the objective's terms (titan.trainer's Objective builds the same, in this order)
        self.terms = tuple(build_terms(job).values())

    def convert(self, model: nn.Module) -> None:
        # on the whole model, before a pipeline split: the last stage keeps the output
        apply_chunked_loss(model, self.chunk_tokens, self.terms)
