"""Qwen3's own config section, [qwen3]: YaRN context extension of a flavor (Qwen3's published
recipe for contexts past the 32k it was trained at, factor 4 for 128k) and the balancing of
the MoE flavors. Torch-free: the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.job_config import opt
from titan.config.moe_options import MoEOptions


@dataclass
class Options(MoEOptions):
    rope_scaling_factor: float | None = opt(
        None, "YaRN: stretch RoPE by this factor (e.g. 4.0 for 131072 positions); None: plain"
    )
    rope_original_max_len: int = opt(
        32768, "YaRN: the context the model was trained at before the extension"
    )
    moe_aux_loss_coeff: float = opt(
        0.001,
        "Qwen3-MoE: weight of the load-balancing loss (logged as moe_aux_loss; 0: off; "
        "unset: the flavor's, 0.001 as Qwen publishes)",
    )
    moe_aux_loss_scope: Literal["sequence", "global_batch"] = opt(
        "sequence",
        "the tokens each balancing-loss term is computed from: every sequence "
        "(their mean is the loss), or the whole global batch (needs one forward per step: no "
        "gradient accumulation, no pipeline); any layout computes the same loss",
    )
    moe_bias_update_rate: float = opt(
        0.0,
        "Qwen3-MoE: move each expert's routing bias by this rate towards the mean load "
        "after every step (DeepSeek-V3's auxiliary-loss-free balancing; 0: off)",
    )
