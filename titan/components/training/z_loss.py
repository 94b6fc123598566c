"""PaLM's z-loss: log(Z)^2 of each counted token's output logits, Z their softmax normalizer,
which keeps the normalizer near 1 and the logits from drifting (bf16 rounding of large logits
is what it guards against)."""

from titan.components.training.loss import z_loss_sum
from titan.components.training.terms import Term


class ZLoss(Term):
    def __init__(self, weight: float):
        self.weight = weight

    def token_sum(self, logits, labels):
        return z_loss_sum(logits, labels)


def build(job) -> ZLoss | None:
    weight = job.training.z_loss_weight
    return ZLoss(weight) if weight else None
