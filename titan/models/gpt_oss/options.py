"""GPT-OSS's own config section, [gpt_oss]: the balancing loss of its experts and its RoPE
stretch. Torch-free: the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.job_config import opt
from titan.config.moe_options import MoEOptions


@dataclass
class Options(MoEOptions):
    moe_aux_loss_coeff: float = opt(
        0.001,
        "weight of the load-balancing loss (logged as moe_aux_loss; 0: off; unset: the "
        "flavor's 0.001, or an HF folder's router_aux_loss_coef)",
    )
    moe_aux_loss_scope: Literal["sequence", "global_batch"] = opt(
        "sequence",
        "the tokens each balancing-loss term is computed from: every sequence "
        "(their mean is the loss), or the whole global batch (needs one forward per step: no "
        "gradient accumulation, no pipeline); any layout computes the same loss",
    )
    rope_scaling_factor: float | None = opt(
        32.0,
        "YaRN: stretch RoPE by this factor over rope_original_max_len positions (released: "
        "32 over 4096); None: plain RoPE; unset: the flavor's",
    )


register(FamilySection("gpt_oss", options=Options))
