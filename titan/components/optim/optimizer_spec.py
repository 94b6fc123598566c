"""The [optimizer] section (which optimizer, its common settings, per-name parameter groups)
and its checks; torch-free. Each optimizer's own settings are its registry entry's section
(registry.py)."""

import re
from dataclasses import dataclass
from typing import Literal

from titan.components.optim.registry import check_name
from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class ParamGroup:
    params: str = opt(
        "", "Regex searched in each parameter's name; the first group matching a parameter takes it"
    )
    lr: float | None = opt(None, "Peak learning rate of the group; None = optimizer.lr")
    weight_decay: float | None = opt(
        None, "Weight decay of the group; None = optimizer.weight_decay"
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer, a name in the optimizer registry (AdamW, Adam, ...)")
    lr: float = opt(8e-4, "Peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "Decoupled weight decay")
    implementation: Literal["fused", "foreach", "for-loop"] = opt(
        "fused", "Kernel: fused, foreach, or for-loop (fused falls back where unsupported)"
    )
    state_dtype: Literal["float32", "bfloat16"] = opt(
        "float32", "Dtype of Adam's moment estimates between steps (the update runs in float32)"
    )
    qk_clip_threshold: float = opt(
        0.0,
        "QK-clip (Kimi K2's MuonClip): after each optimizer step, each attention head whose "
        "largest pre-softmax logit in the step exceeded this has its query/key projections "
        "rescaled to bring it to this (Kimi K2: 100). 0: off",
    )
    param_groups: list[ParamGroup] = opt(
        [],
        "Parameters trained with their own lr or weight decay, by name: "
        "[[optimizer.param_groups]] tables (params = regex, lr, weight_decay); on the command "
        "line in TOML's inline form, '[{params = \"norm\", weight_decay = 0.0}]'",
    )


def _regexes_compile(patterns: list[str]) -> bool:
    try:
        for p in patterns:
            re.compile(p)
    except re.error:
        return False
    return True


def check(job) -> None:
    from titan.config.manager import require_all

    o = job.optimizer
    require_all(
        job,
        (
            (o.lr >= 0, "optimizer.lr", "must be >= 0"),
            (o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0"),
            (
                all(
                    g.params
                    and (g.lr is None or g.lr >= 0)
                    and (g.weight_decay is None or g.weight_decay >= 0)
                    for g in o.param_groups
                ),
                "optimizer.param_groups",
                "each group needs params (a regex of parameter names) and lr, weight_decay >= 0",
            ),
            (
                _regexes_compile([g.params for g in o.param_groups]),
                "optimizer.param_groups",
                "a params regex does not compile (Python re syntax)",
            ),
        ),
    )
    check_name(job)


def check_param_groups(job, plan) -> None:
    """Each param group takes a trainable parameter of the model (a regex matching none, or
    only names an earlier group takes, would silently leave its settings unused)."""
    groups = job.optimizer.param_groups
    if not groups:
        return
    from titan.components.converters import Converters
    from titan.components.optim.registry import clean_name
    from titan.config.manager import require

    model = Converters(job).saved(plan.spec.build_meta(plan.model_args))
    names = [clean_name(n) for n, p in model.named_parameters() if p.requires_grad]
    taken = [0] * len(groups)
    for name in names:
        first = next((i for i, g in enumerate(groups) if re.search(g.params, name)), None)
        if first is not None:
            taken[first] += 1
    for g, n in zip(groups, taken):
        matched = any(re.search(g.params, name) for name in names)
        require(
            job,
            n > 0,
            "optimizer.param_groups",
            f"params = {g.params!r} "
            + (
                "takes no parameter: an earlier group's regex takes all it matches"
                if matched
                else f"matches no trainable parameter (they are named like {', '.join(names[:3])})"
            ),
        )


register(
    Entry(
        "optimizer",
        section="optimizer",
        options=Optimizer,
        check=check,
        plan_check=check_param_groups,
    )
)
