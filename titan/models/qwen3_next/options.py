"""Qwen3-Next's own config section, [qwen3_next]: the balancing of its MoE layers. Torch-free:
the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.job_config import opt
from titan.config.moe_options import MoEOptions


@dataclass
class Options(MoEOptions):
    moe_aux_loss_coeff: float = opt(
        0.001,
        "weight of the load-balancing loss (logged as moe_aux_loss; 0: off; unset: the "
        "flavor's, 0.001 as Qwen publishes)",
    )
    moe_aux_loss_scope: Literal["sequence", "global_batch"] = opt(
        "sequence",
        "the tokens each balancing-loss term is computed from: every sequence (their mean is "
        "the loss), or the whole global batch (needs one forward per step)",
    )
    moe_bias_update_rate: float = opt(
        0.0,
        "move each expert's routing bias by this rate towards the mean load after every step "
        "(DeepSeek-V3's auxiliary-loss-free balancing; 0: off)",
    )
