"""Qwen3-Next's own config section, [qwen3_next]: the balancing of its MoE layers. Torch-free:
the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.moe_options import BalancedMoEOptions


@dataclass
class Options(BalancedMoEOptions):
    pass


register(FamilySection("qwen3_next", options=Options))
