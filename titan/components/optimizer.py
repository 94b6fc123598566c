"""AdamW/Adam with the fastest kernel the parameters allow."""

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def build_optimizer(model_parts: list[nn.Module], name: str, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float,
                    implementation: str) -> torch.optim.Optimizer:
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[name]
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    if implementation == "fused":
        try:
            return cls(params, fused=True, **kw)
        except (RuntimeError, ValueError) as e:
            # fused needs floating params on a supported device; foreach is the next best
            logger.warning("fused %s unavailable (%s); using foreach", name, e)
            implementation = "foreach"
    return cls(params, foreach=implementation == "foreach", **kw)
