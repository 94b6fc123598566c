"""Adam/AdamW: torch's, with the kernel of optimizer.implementation, or with moments kept in
bfloat16 (optimizer.state_dtype)."""

import logging

import torch

from titan.components.optim.low_precision_adam import LowPrecisionStateAdam
from titan.runtime.dtypes import to_dtype

logger = logging.getLogger(__name__)


def build(groups: list[dict], cfg, options=None) -> torch.optim.Optimizer:
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    implementation = cfg.implementation
    if cfg.state_dtype != "float32":
        return LowPrecisionStateAdam(
            groups,
            decoupled_weight_decay=cfg.name == "AdamW",
            state_dtype=to_dtype(cfg.state_dtype),
            implementation=implementation,
            **kw,
        )
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    if implementation == "fused":
        try:
            return cls(groups, fused=True, **kw)
        except (RuntimeError, ValueError) as e:
            # fused needs floating params on a supported device; foreach is the next best
            logger.warning("fused %s unavailable (%s); using foreach", cfg.name, e)
            implementation = "foreach"
    return cls(groups, foreach=implementation == "foreach", **kw)
