"""Freezing part of a model ([freeze], a converter): parameters whose name matches one of
`freeze.params` train no more (no gradient, no optimizer state), e.g. a vision-language
model's tower (`^visual\\.`) or its decoder (`^(?!visual\\.)`); checkpoints and exports still
hold them. Torch-free (the converter is freeze.py)."""

import re
from dataclasses import dataclass

from titan.components.converters import ConverterSpec
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Freeze:
    params: list[str] = opt(
        [],
        "Regexes searched in each parameter's name (visual.blocks.0.attn.qkv.weight, "
        r"layers.0.attention.wq.weight); what any matches is not trained. ^visual\. freezes "
        r"a vision tower, ^(?!visual\.) the rest of the model; empty: nothing frozen",
    )


def check(job) -> None:
    from titan.config.manager import require

    for pattern in job.freeze.params:
        try:
            re.compile(pattern)
        except re.error as e:
            require(job, False, "freeze.params", f"{pattern!r} is not a regex ({e})")


def plan_check(job, plan) -> None:
    """Patterns that freeze something, and not everything."""
    from titan.components.training.freeze import frozen_names
    from titan.config import ConfigError

    names = [n for n, _ in plan.spec.build_meta(plan.model_args).named_parameters()]
    frozen = frozen_names(names, job.freeze.params)
    if not frozen or len(frozen) == len(names):
        what = "no" if not frozen else "every"
        raise ConfigError(
            f"freeze.params {job.freeze.params} match {what} parameter of {job.model.name} "
            f"{job.model.flavor!r} (e.g. {names[0]}, {names[-1]}); fix the patterns"
        )


register(
    ConverterSpec(
        "freeze",
        build="titan.components.training.freeze:FreezeConverter",
        enabled=lambda job: bool(job.freeze.params),
        check=check,
        plan_check=plan_check,
        section="freeze",
        options=Freeze,
        order=40,
    )
)
