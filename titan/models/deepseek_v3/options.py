"""DeepSeek-V3's own config section, [deepseek_v3]: the balancing of the experts and YaRN
context extension. Torch-free: the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.job_config import opt


@dataclass
class Options:
    moe_bias_update_rate: float = opt(
        0.001,
        "move each expert's routing bias by this rate towards the mean load after every "
        "step (auxiliary-loss-free balancing; 0: off; unset: the flavor's, 0.001 as published)",
    )
    moe_aux_loss_coeff: float = opt(
        0.0001,
        "weight of the balance loss (logged as moe_aux_loss; 0: off; "
        "unset: the flavor's, 0.0001 as published)",
    )
    moe_aux_loss_scope: Literal["sequence", "global_batch"] = opt(
        "sequence",
        "the tokens each balancing-loss term is computed from: every sequence "
        "(their mean is the loss), or the whole global batch (needs one forward per step: no "
        "gradient accumulation, no pipeline); any layout computes the same loss",
    )
    rope_scaling_factor: float | None = opt(
        None,
        "YaRN: stretch RoPE by this factor (671B's: 40, for 163840 positions); None: "
        "plain RoPE; unset: the flavor's",
    )
