"""Freezing part of a model ([frozen], a converter): parameters whose name matches one of
`frozen.params` train no more (no gradient, no optimizer state), e.g. a vision-language
model's tower (`^visual\\.`) or its decoder (`^(?!visual\\.)`); checkpoints and exports still
hold them. Torch-free (the converter is frozen.py)."""

import re
from dataclasses import dataclass

from titan.components.converters import ConverterSpec
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Frozen:
    params: list[str] = opt(
        [],
        "Regexes searched in each parameter's name (visual.blocks.0.attn.qkv.weight, "
        r"layers.0.attention.wq.weight); what any matches is not trained. ^visual\. freezes "
        r"a vision tower, ^(?!visual\.) the rest of the model; empty: nothing frozen",
    )


def check(job) -> None:
    from titan.config.manager import require

    for pattern in job.frozen.params:
        try:
            re.compile(pattern)
        except re.error as e:
            require(job, False, "frozen.params", f"{pattern!r} is not a regex ({e})")


def plan_check(job, plan) -> None:
    """Patterns that freeze something, and not everything."""
    from titan.components.training.frozen import frozen_names
    from titan.config import ConfigError

    names = [n for n, _ in plan.spec.build_meta(plan.model_args).named_parameters()]
    frozen = frozen_names(names, job.frozen.params)
    if not frozen or len(frozen) == len(names):
        what = "no" if not frozen else "every"
        raise ConfigError(
            f"frozen.params {job.frozen.params} match {what} parameter of {job.model.name} "
            f"{job.model.flavor!r} (e.g. {names[0]}, {names[-1]}); fix the patterns"
        )


register(
    ConverterSpec(
        "frozen",
        build="titan.components.training.frozen:FrozenConverter",
        enabled=lambda job: bool(job.frozen.params),
        check=check,
        plan_check=plan_check,
        section="frozen",
        options=Frozen,
        order=40,
    )
)
