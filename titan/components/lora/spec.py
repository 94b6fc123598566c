"""LoRA's converter entry (on when `lora.rank` > 0) and its [lora] section; torch-free (the
converter is titan.components.lora.training.LoraConverter)."""

import re
from dataclasses import dataclass

from titan.components.converters import ConverterSpec
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Lora:
    rank: int = opt(
        0,
        "Low-rank adapters of this rank on the target linear layers, the base weights frozen "
        "(no gradients, no optimizer state, checkpoints hold the adapters only); 0: off",
    )
    alpha: float = opt(16.0, "The adapters' output is scaled by alpha / rank (as PEFT's)")
    dropout: float = opt(0.0, "Dropout on the adapters' input while training")
    target_modules: list[str] = opt(
        [r"attention\.w\w*$"],
        "Regexes searched in each linear layer's name (layers.0.attention.wq) and each routed "
        "experts' weight's (layers.1.feed_forward.experts.w1); what any matches gets adapters. "
        r"Default: every attention projection; feed_forward\.w[123]$ adds a dense FFN, "
        r"experts\.w[123]$ the shared and routed experts (one adapter per expert)",
    )


def check(job) -> None:
    """Sane settings, no other rewrite of the same layers, and a base of weights only."""
    from titan.config.manager import require

    lora = job.lora
    for key, ok, why in (
        ("lora.rank", lora.rank > 0, "must be > 0 (0 turns LoRA off)"),
        ("lora.alpha", lora.alpha > 0, "must be > 0"),
        ("lora.dropout", 0 <= lora.dropout < 1, "must be in [0, 1)"),
        (
            "model.converters",
            "float8" not in job.model.converters,
            "float8 and LoRA both rewrite the linear layers; use one of them",
        ),
        (
            "checkpoint.initial_load_model_only",
            job.checkpoint.initial_load_model_only or not job.checkpoint.initial_load_path,
            "LoRA starts from the base model's weights only (its optimizer state has no "
            "place in the adapters')",
        ),
    ):
        require(job, ok, key, why)
    for pattern in lora.target_modules:
        try:
            re.compile(pattern)
        except re.error as e:
            require(job, False, "lora.target_modules", f"{pattern!r} is not a regex ({e})")


def plan_check(job, plan) -> None:
    """Targets that name plain linear layers or routed experts' weights of this model."""
    from titan.components.lora.adapters import apply_lora
    from titan.config import ConfigError

    train_spec, model_args = plan.spec, plan.model_args

    try:
        apply_lora(train_spec.build_meta(model_args), job.lora)
    except ValueError as e:
        raise ConfigError(str(e)) from None


register(
    ConverterSpec(
        "lora",
        build="titan.components.lora.training:LoraConverter",
        enabled=lambda job: job.lora.rank != 0,
        check=check,
        plan_check=plan_check,
        section="lora",
        options=Lora,
        order=30,
    )
)
