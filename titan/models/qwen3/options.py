"""Qwen3's own config section, [qwen3]: YaRN context extension of a flavor (Qwen3's published
recipe for contexts past the 32k it was trained at, factor 4 for 128k) and the balancing of
the MoE flavors. Torch-free: the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.job_config import opt
from titan.config.moe_options import BalancedMoEOptions


@dataclass
class Options(BalancedMoEOptions):
    rope_scaling_factor: float | None = opt(
        None, "YaRN: stretch RoPE by this factor (e.g. 4.0 for 131072 positions); None: plain"
    )
    rope_original_max_len: int = opt(
        32768, "YaRN: the context the model was trained at before the extension"
    )


register(FamilySection("qwen3", options=Options))
