"""AdamW/Adam, one optimizer per model part (pipeline stage), stepped as one.

One optimizer per part keeps optimizer state addressable by each part's own parameter names,
which is what lets a checkpoint written under one pipeline split load under another.
"""

import logging

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from titan.components.optim.low_precision_adam import LowPrecisionStateAdam
from titan.components.checkpoint.tied_state import saved_form, saved_key, tied_names
from titan.dtypes import to_dtype

logger = logging.getLogger(__name__)

# tensors only (exp_avg, exp_avg_sq, step): hyper-parameters come from the config on resume
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _build_one(params, name: str, implementation: str, kw: dict,
               state_dtype: str = "float32") -> torch.optim.Optimizer:
    if state_dtype != "float32":
        return LowPrecisionStateAdam(params, decoupled_weight_decay=name == "AdamW",
                                     state_dtype=to_dtype(state_dtype),
                                     implementation=implementation, **kw)
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[name]
    if implementation == "fused":
        try:
            return cls(params, fused=True, **kw)
        except (RuntimeError, ValueError) as e:
            # fused needs floating params on a supported device; foreach is the next best
            logger.warning("fused %s unavailable (%s); using foreach", name, e)
            implementation = "foreach"
    return cls(params, foreach=implementation == "foreach", **kw)


def _groups_by_mesh(params: list[nn.Parameter]) -> list[nn.Parameter] | list[dict]:
    """One param group per device mesh when the parameters span several (expert-parallel
    experts beside the dense weights): foreach and fused steps take one mesh at a time.
    Checkpoints hold the state by parameter name, so the grouping does not reach them."""
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(by_mesh) < 2:
        return params
    return [{"params": group} for group in by_mesh.values()]


class OptimizersContainer:
    """Looks like one optimizer; is a Stateful for DCP."""

    def __init__(self, model_parts: list[nn.Module], cfg):
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  weight_decay=cfg.weight_decay)
        self.model_parts = model_parts
        self.ties = tied_names(model_parts)
        self.optimizers = [
            _build_one(_groups_by_mesh([p for p in part.parameters() if p.requires_grad]),
                       cfg.name, cfg.implementation, kw, cfg.state_dtype)
            for part in model_parts
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


def build_optimizer(model_parts: list[nn.Module], cfg) -> OptimizersContainer:
    """One optimizer per part, from `cfg` (the optimizer section)."""
    return OptimizersContainer(model_parts, cfg)
