"""GPT-OSS's own config section, [gpt_oss]: the balancing loss of its experts and its RoPE
stretch. Torch-free: the config parser loads it (titan.config.family_options)."""

from dataclasses import dataclass

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.job_config import opt
from titan.config.moe_options import AuxLossScope, MoEOptions, aux_loss_scope


@dataclass
class Options(MoEOptions):
    moe_aux_loss_coeff: float = opt(
        0.001,
        "weight of the load-balancing loss (logged as moe_aux_loss; 0: off; unset: the "
        "flavor's 0.001, or an HF folder's router_aux_loss_coef)",
    )
    moe_aux_loss_scope: AuxLossScope = aux_loss_scope()
    rope_scaling_factor: float | None = opt(
        32.0,
        "YaRN: stretch RoPE by this factor over rope_original_max_len positions (released: "
        "32 over 4096); None: plain RoPE; unset: the flavor's",
    )


register(FamilySection("gpt_oss", options=Options))
