"""An objective term: the mean squared output logit of each counted token (a penalty that
keeps the logits small), with its [logit_l2] section; logged as `logit_l2`."""

from dataclasses import dataclass

from titan.components.training.terms import Term, TermSpec
from titan.config.extensions import register
from titan.config.job_config import opt


@dataclass
class LogitL2Options:
    weight: float = opt(0.0, "Weight of the mean squared logit in the objective; 0: off")


class LogitL2(Term):
    def __init__(self, weight: float):
        self.weight = weight

    def token_sum(self, logits, labels):
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):  # vocabulary-parallel: each rank holds a slice
            logits = logits.full_tensor()
        per_token = logits.float().square().mean(dim=-1)
        return (per_token * (labels != -100)).sum()


def build(job):
    weight = job.extensions["logit_l2"].weight
    return LogitL2(weight) if weight else None


def _check(job):
    from titan.config import ConfigError

    weight = job.extensions["logit_l2"].weight
    if weight < 0:
        raise ConfigError(f"logit_l2.weight = {weight}: give a value >= 0 (0: off)")


SPEC = TermSpec(
    "logit_l2", build=f"{__name__}:build", check=_check, section="logit_l2", options=LogitL2Options
)
register(SPEC)
