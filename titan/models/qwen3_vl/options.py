"""Qwen3-VL's own config section, [qwen3_vl]: the balancing of its MoE flavors. Torch-free:
the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.moe_options import BalancedMoEOptions


@dataclass
class Options(BalancedMoEOptions):
    pass


register(FamilySection("qwen3_vl", options=Options))
