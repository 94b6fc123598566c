"""DeepSeek-V3's own config section, [deepseek_v3]: the balancing of the experts, YaRN
context extension and multi-token prediction. Torch-free: the config parser loads it
(titan.config.family_options)."""

from dataclasses import dataclass

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.job_config import opt
from titan.config.moe_options import AuxLossScope, MoEOptions, aux_loss_scope


@dataclass
class Options(MoEOptions):
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
    moe_aux_loss_scope: AuxLossScope = aux_loss_scope()
    rope_scaling_factor: float | None = opt(
        None,
        "YaRN: stretch RoPE by this factor (671B's: 40, for 163840 positions); None: "
        "plain RoPE; unset: the flavor's",
    )
    mtp_depth: int = opt(
        0,
        "multi-token prediction: this many extra depths, each predicting one token further "
        "with its own block, sharing the embedding and output head (DeepSeek-V3: 1; 0: off; "
        "unset: the flavor's, or an HF folder's num_nextn_predict_layers)",
    )
    mtp_loss_weight: float = opt(
        0.3,
        "weight of the multi-token-prediction loss, the mean of its depths' (logged as "
        "mtp_loss; DeepSeek-V3: 0.3, then 0.1 for the last 2.5T tokens)",
    )


register(FamilySection("deepseek_v3", options=Options))
