"""Float8 training through torchao (`model.converters = ["float8"]`, the [float8] section):
every eligible `nn.Linear` of the meta-device model becomes torchao's `Float8Linear` before any
parallelism is applied, as torchtitan does. The weights stay in float32 (checkpoints and HF
exports hold plain weights); only the matmuls run in float8.
"""

from __future__ import annotations

import logging

from torch import nn

from titan.components.converters import Converter

logger = logging.getLogger(__name__)

MISSING = "float8 needs torchao: pip install -e '.[float8]'"


def _eligible(filter_fqns: list[str]):
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
            return False
        # float8 matmuls need both dims to be multiples of 16
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep


def apply_float8(model: nn.Module, cfg) -> int:
    """Swap eligible linears for Float8Linear by `cfg` (the float8 section); returns how many."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe_name == "tensorwise":
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather, emulate=cfg.emulate
        )
    else:
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(cfg.recipe_name), emulate=cfg.emulate
        )
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=_eligible(cfg.filter_fqns))
    from torchao.float8.float8_linear import Float8Linear

    swapped = sum(isinstance(m, Float8Linear) for m in model.modules())
    logger.info(
        "float8 (%s%s): %d of %d linear layers",
        cfg.recipe_name,
        ", emulated" if cfg.emulate else "",
        swapped,
        before,
    )
    return swapped


def scale_precomputer(parts: list[nn.Module], cfg):
    """What to run after each optimizer step: one pass that computes the scales of all
    float8 weights FSDP will all-gather (None when not configured)."""
    if not (cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(taken: bool) -> None:
        if not taken:
            return  # the weights did not change
        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return precompute


class Float8Converter(Converter):
    """The converter entry: float8 linears, and their scales after each step when FSDP
    all-gathers them in float8."""

    def __init__(self, job):
        self.cfg = job.float8

    def convert(self, model: nn.Module) -> None:
        apply_float8(model, self.cfg)

    def post_optimizer_hook(self, parts: list[nn.Module]):
        return scale_precomputer(parts, self.cfg)
