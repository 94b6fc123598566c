"""The frozen converter (titan.components.training.frozen_spec): the matching parameters
stop requiring gradients on the meta model, before any parallelism, which keeps them frozen
(as LoRA's base weights are)."""

import logging
import re

from titan.components.converters import Converter
from titan.runtime.names import canonical_name

logger = logging.getLogger(__name__)


def frozen_names(names, patterns: list[str]) -> list[str]:
    compiled = [re.compile(p) for p in patterns]
    return [n for n in names if any(p.search(canonical_name(n)) for p in compiled)]


class FrozenConverter(Converter):
    def __init__(self, job):
        self.patterns = list(job.frozen.params)

    def convert(self, model) -> None:
        names = dict(model.named_parameters())
        for name in frozen_names(names, self.patterns):
            names[name].requires_grad_(False)

    def describe(self, parts, pipelined: bool) -> None:
        params = [p for part in parts for p in part.parameters()]
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        logger.info(
            "frozen: %.3fM of %.3fM parameters frozen (%s)%s",
            frozen / 1e6,
            sum(p.numel() for p in params) / 1e6,
            ", ".join(self.patterns),
            " on this rank's stages" if pipelined else "",
        )

    def identity(self) -> dict:
        # a resume trains the same parameters (the optimizer state holds those)
        return {"frozen": self.patterns}
