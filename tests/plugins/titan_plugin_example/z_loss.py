"""An objective term: the z-loss, the squared log of the softmax normalizer of the output
logits, per counted token (PaLM's, keeping the logits from drifting), with its [z_loss]
section; logged as `z_loss`."""

from dataclasses import dataclass

from titan.components.training.terms import Term, TermSpec, register_term
from titan.config.job_config import opt


@dataclass
class ZLossOptions:
    weight: float = opt(0.0, "Weight of the z-loss in the objective (PaLM: 1e-4); 0: off")


class ZLoss(Term):
    def __init__(self, weight: float):
        self.weight = weight

    def token_sum(self, logits, labels):
        import torch
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):  # vocabulary-parallel: each rank holds a slice
            logits = logits.full_tensor()
        z = torch.logsumexp(logits.float(), dim=-1)
        return (z.square() * (labels != -100)).sum()


def build(job):
    weight = job.extensions["z_loss"].weight
    return ZLoss(weight) if weight else None


def _check(job):
    from titan.config import ConfigError

    weight = job.extensions["z_loss"].weight
    if weight < 0:
        raise ConfigError(f"z_loss.weight = {weight}: give a value >= 0 (0: off)")


SPEC = TermSpec(
    "z_loss", build=f"{__name__}:build", check=_check, section="z_loss", options=ZLossOptions
)
register_term(SPEC)
