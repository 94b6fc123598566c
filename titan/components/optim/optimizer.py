"""The optimizer of optimizer.name (titan.components.optim.registry), one per model part
(pipeline stage), stepped as one.

One optimizer per part keeps optimizer state addressable by each part's own parameter names,
which is what lets a checkpoint written under one pipeline split load under another.
"""

import logging
import re
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from titan.components.checkpoint.tied_state import saved_form, saved_key, tied_names
from titan.components.optim.registry import clean_name, optimizer_spec
from titan.config import ConfigError, extensions

logger = logging.getLogger("titan")

# tensors only (exp_avg, exp_avg_sq, step): hyper-parameters come from the config on resume
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def param_groups(part: nn.Module, cfg, lr_scale: Callable[[str, Any], float] | None = None):
    """The trainable parameters of `part` in groups: those of each optimizer.param_groups entry
    (the first whose regex a name matches), then the rest, with the lr and weight decay each
    trains with; each split further by device mesh when the parameters span several (expert-
    parallel experts beside the dense weights): foreach and fused steps take one mesh at a
    time. `lr_scale(name, param)`, where given, multiplies each parameter's lr (the model
    converters' per-parameter factors), splitting a group by factor. Checkpoints hold the state
    by parameter name, so the grouping does not reach them."""
    rules = [(re.compile(g.params), g) for g in cfg.param_groups]
    by_key: dict = {}
    for name, p in part.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_name(name)
        rule = next((i for i, (pattern, _) in enumerate(rules) if pattern.search(name)), len(rules))
        scale = 1.0 if lr_scale is None else lr_scale(name, p)
        group = by_key.setdefault(
            (rule, scale, getattr(p, "device_mesh", None)), {"params": [], "param_names": []}
        )
        group["params"].append(p)
        group["param_names"].append(name)
    for (rule, scale, _), group in by_key.items():
        settings = rules[rule][1] if rule < len(rules) else None
        group["lr"] = scale * (cfg.lr if settings is None or settings.lr is None else settings.lr)
        group["weight_decay"] = (
            cfg.weight_decay
            if settings is None or settings.weight_decay is None
            else settings.weight_decay
        )
    return [by_key[k] for k in sorted(by_key, key=lambda k: k[:2])]


def _any_rank_trains(model_parts: list[nn.Module]) -> bool:
    """Whether a parameter trains on any rank (a pipeline stage may hold only frozen ones);
    collective when a process group exists."""
    import torch
    import torch.distributed as dist

    params = [p for part in model_parts for p in part.parameters()]
    mine = any(p.requires_grad for p in params)
    if not dist.is_initialized():
        return mine
    device = params[0].device if params else torch.device("cpu")
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class OptimizersContainer:
    """Looks like one optimizer; is a Stateful for DCP."""

    def __init__(self, model_parts: list[nn.Module], cfg, sections: dict, lr_scale=None):
        spec = optimizer_spec(cfg.name)
        build, options = extensions.load(spec.build), spec.options_in(sections)
        if not _any_rank_trains(model_parts):
            raise ConfigError(
                "no parameter of the model trains: model.converters froze every one, so "
                "nothing would be learned; leave some unfrozen"
            )
        self.model_parts = model_parts
        self.ties = tied_names(model_parts)
        self.optimizers = [
            build(param_groups(part, cfg, lr_scale), cfg, options) for part in model_parts
        ]

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        out = {}
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            sd = get_optimizer_state_dict(part, opt, options=_OPTIONS)
            out.update({k: v for k, v in sd.items() if k.startswith("state.")})
        # a tied weight's moments once, as its weight (a pipeline copy's equal its owner's)
        return saved_form(out, self.ties, "state.")

    def load_state_dict(self, state: dict) -> None:
        taken = set()
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            # start from the live dict (param groups, this part's keys) and fill in saved state
            sd = get_optimizer_state_dict(part, opt, options=_OPTIONS)
            for k in sd:
                saved = saved_key(k, self.ties, "state.")
                if saved in state:
                    value = state[saved]
                    # a tied owner and its copy on this rank (V schedules) each step their own
                    # moments: one tensor for both would be updated twice a step
                    sd[k] = value.clone() if id(value) in taken else value
                    taken.add(id(value))
            set_optimizer_state_dict(part, opt, sd, options=_OPTIONS)


def build_optimizer(
    model_parts: list[nn.Module], cfg, sections: dict, lr_scale=None
) -> OptimizersContainer:
    """One optimizer per part, from `cfg` (the optimizer section) and, for an optimizer with a
    section of its own, that section among `sections` (the job's added ones); `lr_scale`: see
    param_groups."""
    if cfg.lr == 0 and not any(g.lr for g in cfg.param_groups):
        # an evaluation-only run, a data-pipeline check: torchtitan accepts it too
        logger.warning(
            "optimizer.lr = 0 and no param group's lr is above it: no weight will change "
            "(set optimizer.lr > 0 to train)"
        )
    return OptimizersContainer(model_parts, cfg, sections, lr_scale)
