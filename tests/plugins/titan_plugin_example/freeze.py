"""A model converter: the named top-level modules (by default the token embedding and the output
layer) keep their initial weights while the rest trains, with its own [freeze] section; on by
`model.converters = ["freeze"]`."""

import logging
from dataclasses import dataclass

from titan.components.converters import Converter, ConverterSpec
from titan.config.extensions import register
from titan.config.job_config import opt

logger = logging.getLogger(__name__)


@dataclass
class FreezeOptions:
    modules: list[str] = opt(
        ["tok_embeddings", "output"], "Top-level modules whose parameters do not train"
    )


class Freeze(Converter):
    def __init__(self, job):
        self.modules = job.extensions["freeze"].modules

    def convert(self, model):
        for name in self.modules:
            for p in model.get_submodule(name).parameters():
                p.requires_grad_(False)

    def describe(self, parts, pipelined):
        frozen = sum(p.numel() for part in parts for p in part.parameters() if not p.requires_grad)
        logger.info("frozen: %s (%d parameters)", ", ".join(self.modules), frozen)


def _check(job):
    from titan.config import ConfigError

    if not job.extensions["freeze"].modules:
        raise ConfigError("freeze.modules = []: name a module to freeze, or drop 'freeze'")


SPEC = ConverterSpec(
    "freeze", build=f"{__name__}:Freeze", check=_check, section="freeze", options=FreezeOptions
)
register(SPEC)
