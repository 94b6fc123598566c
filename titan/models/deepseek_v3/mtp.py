"""DeepSeek-V3's multi-token prediction (the DeepSeek-V3 report, section 2.2): D extra depths
after the main model, sharing its embedding and output head. Depth k combines, at each
position i, the hidden state of depth k-1 (the main model's normalized output for k = 1) with
the embedding of token i+k:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})]),   h^k = TRM_k(h')

(the embedding first, as the released checkpoints' eh_proj is laid out), and predicts token
i+k+1 from head_norm(h^k) through the shared output head. Its loss is the mean over the depths
of each depth's cross-entropy summed over the positions that have a target and divided by all
positions (the report's 1/T), added to the main loss times `mtp_loss_weight`.

The tokens and targets come from the step's labels (label i is token i+1): depth k reads the
embedding of label i+k-1 and the target label i+k, so the last k positions of a row have no
target (torchtitan's alignment). A depth's block is `layers.{n_layers + k - 1}`, the name the
released checkpoints give it, so parallelisms treat it as any block."""

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.aux_loss import attach_aux_loss
from titan.models.common.decoder import TransformerBlock
from titan.models.common.init import normal, ones

MTP_LOSS_NAME = "mtp_loss"  # how metrics.jsonl and TensorBoard name it
IGNORE = -100


class MTPBlock(TransformerBlock):
    """One prediction depth: the two norms and the projection that merge its inputs, a
    transformer block, and the norm before the shared output head."""

    def __init__(self, layer_id: int, dim: int, norm_eps: float, attention, feed_forward):
        super().__init__(layer_id, dim, norm_eps, attention, feed_forward)
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.head_norm = nn.RMSNorm(dim, eps=norm_eps)

    def param_inits(self) -> dict:
        return {
            **super().param_inits(),
            "enorm.weight": ones,
            "hnorm.weight": ones,
            "head_norm.weight": ones,
            "eh_proj.weight": normal(0.02),
        }

    def forward(self, previous, embedded, rope, mask=None):
        """(h^k, head_norm(h^k)) from h^{k-1} and the embeddings of the depth's tokens."""
        merged = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        h = super().forward(merged, rope, mask=mask)
        return h, self.head_norm(h)


def shifted(labels: torch.Tensor, by: int, fill: int) -> torch.Tensor:
    """labels[:, i + by] at position i, `fill` past the row's end."""
    out = torch.full_like(labels, fill)
    out[:, : labels.shape[1] - by] = labels[:, by:]
    return out


def mtp_loss(
    blocks: list[MTPBlock],
    embedding: nn.Module,
    output: nn.Module,
    h: torch.Tensor,
    labels: torch.Tensor,
    rope: torch.Tensor,
    mask=None,
) -> torch.Tensor:
    """The mean over the depths of their losses (each: the summed cross-entropy of the
    positions with a target, over all positions of `labels`)."""
    total = 0.0
    for k, block in enumerate(blocks, start=1):
        h, normed = block(h, embedding(shifted(labels, k - 1, 0)), rope, mask=mask)
        logits = output(normed)
        targets = shifted(labels, k, IGNORE)
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(),
            targets.flatten(0, 1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        total = total + ce / labels.numel()
    return total / len(blocks)


def attach_mtp_loss(logits: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
    """`logits` carrying the MTP loss into backward (times `weight`), logged as mtp_loss."""
    return attach_aux_loss(logits, MTP_LOSS_NAME, loss, weight)
