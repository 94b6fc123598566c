"""SGD with momentum (torch's) as a registered optimizer, with its own [sgd] section."""

from dataclasses import dataclass

from titan.components.optim.registry import OptimizerSpec
from titan.config.extensions import register
from titan.config.job_config import opt


@dataclass
class SGDOptions:
    momentum: float = opt(0.9, "SGD: momentum (0 keeps no state)")
    nesterov: bool = opt(False, "SGD: Nesterov momentum")


def build(groups, cfg, options):
    import torch

    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=options.momentum, nesterov=options.nesterov, foreach=False
    )


def state_bytes(name, shape, elements, cfg, options) -> int:
    return 4 * elements if options.momentum else 0  # one float32 momentum buffer


def check(job) -> None:
    from titan.config.manager import require

    require(job, 0 <= job.sgd.momentum < 1, "sgd.momentum", "must lie in [0, 1)")
    require(
        job, not job.sgd.nesterov or job.sgd.momentum > 0, "sgd.nesterov", "needs sgd.momentum > 0"
    )


register(
    OptimizerSpec(
        "SGD",
        build=f"{__name__}:build",
        state_bytes=state_bytes,
        check=check,
        section="sgd",
        options=SGDOptions,
    )
)
