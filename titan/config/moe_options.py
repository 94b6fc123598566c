"""The settings every MoE family's config section has ([qwen3], [deepseek_v3], [gpt_oss]):
token dropping and the router z-loss (and the Qwen families' balancing). A family's `Options`
inherits them; its args carry the same names (titan.models.common.moe_args.MoETraining).
Torch-free, as the sections are."""

from dataclasses import dataclass
from typing import Literal

from titan.config.job_config import opt

AuxLossScope = Literal["sequence", "global_batch"]


def aux_loss_scope():
    """The `moe_aux_loss_scope` option, alike in every family that has a balancing loss."""
    return opt(
        "sequence",
        "the tokens each balancing-loss term is computed from: every sequence "
        "(their mean is the loss), or the whole global batch (needs one forward per step: no "
        "gradient accumulation, no pipeline); any layout computes the same loss",
    )


@dataclass
class MoEOptions:
    moe_capacity_factor: float | None = opt(
        None,
        "MoE token dropping: each expert takes at most ceil(factor x top_k x S / experts) "
        "token choices of each sequence of S tokens (this rank's part of it under context or "
        "sequence parallelism); the rest pass through the residual only. None: dropless",
    )
    moe_drop_policy: Literal["probs", "position"] = opt(
        "probs",
        "which choices an over-full expert keeps: its highest routing weights ('probs') or "
        "the sequence's earliest tokens ('position')",
    )
    moe_pad_to_capacity: bool = opt(
        False,
        "every expert computes exactly its capacity of rows, zero rows filling the rest "
        "(static shapes whatever the routing; needs moe_capacity_factor)",
    )
    moe_router_z_loss_coeff: float = opt(
        0.0,
        "ST-MoE's router z-loss weight: the mean over tokens of logsumexp(router logits)^2 "
        "(logged as moe_z_loss; 0: off; ST-MoE used 0.001)",
    )


@dataclass
class BalancedMoEOptions(MoEOptions):
    """The Qwen families' balancing: Switch-style loss and DeepSeek-V3's routing bias."""

    moe_aux_loss_coeff: float = opt(
        0.001,
        "weight of the load-balancing loss (logged as moe_aux_loss; 0: off; unset: the "
        "flavor's, 0.001 as Qwen publishes)",
    )
    moe_aux_loss_scope: AuxLossScope = aux_loss_scope()
    moe_bias_update_rate: float = opt(
        0.0,
        "move each expert's routing bias by this rate towards the mean load after every step "
        "(DeepSeek-V3's auxiliary-loss-free balancing; 0: off)",
    )
