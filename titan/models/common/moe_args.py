"""The settings of an MoE layer (titan.models.common.moe), torch-free so that a family's args
module stays light (the launcher's config check imports every family's args)."""

import math
from dataclasses import dataclass, replace
from typing import ClassVar

AUX_LOSSES = ("none", "load_balancing", "deepseek")
# the token groups a balancing loss is computed over (titan.models.common.moe); each is kept
# whole whatever the layout: a sequence always, the global batch when a step is one forward
AUX_LOSS_SCOPES = ("sequence", "global_batch")
# a family's args fields that set its MoE layers' balancing: training settings, not the
# architecture (their `training_knobs`, titan.components.checkpoint.identity)
BALANCING_KNOBS = ("moe_aux_loss_coeff", "moe_bias_update_rate", "moe_aux_loss_scope")
DROP_POLICIES = ("probs", "position")
# the training settings every MoE family's section has (titan.models.common.moe_options) and
# its args carry under the same names (MoETraining)
TRAINING_KNOBS = (
    "moe_capacity_factor",
    "moe_drop_policy",
    "moe_pad_to_capacity",
    "moe_router_z_loss_coeff",
)


@dataclass(frozen=True)
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 128  # each expert's SwiGLU width (HF: moe_intermediate_size)
    score_func: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalize the k chosen weights to sum to 1
    n_groups: int = 1  # experts are split into groups; a token may use topk_groups of them
    topk_groups: int = 1
    route_scale: float = 1.0  # DeepSeek-V3's routed_scaling_factor
    score_bias: bool = False  # a per-expert bias added to the scores for the choice only
    n_shared_experts: int = 0  # one SwiGLU of n_shared_experts x hidden_dim on every token
    # balancing: after each optimizer step, the score bias moves by this rate towards the mean
    # load (DeepSeek-V3's auxiliary-loss-free rule; 0: off; needs score_bias)
    bias_update_rate: float = 0.0
    # an auxiliary loss added to what backward sees, per layer, times aux_loss_coeff:
    # "load_balancing" (Switch Transformer's, Qwen3-MoE's) or "deepseek" (DeepSeek-V3's: the
    # counts over top_k, each token's scores normalized to sum to 1)
    aux_loss: str = "none"
    aux_loss_coeff: float = 0.0
    # the tokens whose routing counts and scores one loss term is computed from: each
    # "sequence" (averaged over the global batch), or the whole "global_batch"
    aux_loss_scope: str = "sequence"
    # token dropping: each expert takes at most ceil(capacity_factor x k x S / n_experts) of
    # the choices of each routing group of S tokens (a sequence, or this rank's part of it
    # under context or sequence parallelism); None: dropless. A dropped choice adds nothing:
    # a token that loses all k passes through the residual (and the shared experts) only
    capacity_factor: float | None = None
    # which choices an over-full expert keeps: its highest routing weights ("probs") or the
    # earliest tokens of the group ("position")
    drop_policy: str = "probs"
    # every expert computes exactly its capacity of rows (zero rows fill the rest): static
    # shapes, the same work whatever the routing
    pad_to_capacity: bool = False
    # ST-MoE's router z-loss: the mean over tokens of logsumexp(router logits)^2, times this
    router_z_loss_coeff: float = 0.0
    # what a run may change without changing the model (titan.components.checkpoint.identity)
    training_knobs: ClassVar[tuple[str, ...]] = (
        "bias_update_rate",
        "aux_loss",
        "aux_loss_coeff",
        "aux_loss_scope",
        "capacity_factor",
        "drop_policy",
        "pad_to_capacity",
        "router_z_loss_coeff",
    )

    def capacity(self, group_tokens: int) -> int | None:
        """The choices one expert takes of a routing group of `group_tokens` tokens (Megatron's
        ceil(tokens x k / experts x factor)); None: dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(group_tokens * self.top_k / self.n_experts * self.capacity_factor)

    def layer_params(self, dim: int, active: bool = False) -> int:
        """The router, routed and shared experts of one layer; `active`: those one token uses
        (its top_k routed experts)."""
        routed = self.top_k if active else self.n_experts
        return dim * self.n_experts + 3 * dim * self.hidden_dim * (routed + self.n_shared_experts)

    def problems(self) -> list[str]:
        """What is wrong with these settings, each naming its fields (empty: nothing)."""
        out = []
        if self.bias_update_rate < 0:
            out.append(f"bias_update_rate {self.bias_update_rate} must be >= 0")
        elif self.bias_update_rate and not self.score_bias:
            out.append(f"bias_update_rate {self.bias_update_rate} needs score_bias")
        if self.aux_loss not in AUX_LOSSES:
            out.append(f"aux_loss {self.aux_loss!r} is not one of {', '.join(AUX_LOSSES)}")
        if self.aux_loss_coeff < 0:
            out.append(f"aux_loss_coeff {self.aux_loss_coeff} must be >= 0")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            out.append(
                f"aux_loss_scope {self.aux_loss_scope!r} is not one of {', '.join(AUX_LOSS_SCOPES)}"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            out.append(f"capacity_factor {self.capacity_factor} must be > 0 (or None: dropless)")
        if self.drop_policy not in DROP_POLICIES:
            out.append(f"drop_policy {self.drop_policy!r} is not one of {', '.join(DROP_POLICIES)}")
        if self.pad_to_capacity and self.capacity_factor is None:
            out.append("pad_to_capacity needs a capacity_factor")
        if self.router_z_loss_coeff < 0:
            out.append(f"router_z_loss_coeff {self.router_z_loss_coeff} must be >= 0")
        if self.score_func not in ("softmax", "sigmoid"):
            out.append(f"score_func {self.score_func!r} is not 'softmax' or 'sigmoid'")
        if not 1 <= self.top_k <= self.n_experts:
            out.append(f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
        if self.n_groups < 1 or self.n_experts % self.n_groups:
            out.append(f"n_groups {self.n_groups} must divide n_experts {self.n_experts}")
        elif self.n_groups > 1:
            per_group = self.n_experts // self.n_groups
            if per_group < 2:  # a group's score is the sum of its two best experts
                out.append(f"n_groups {self.n_groups} leaves fewer than 2 experts per group")
            if not 1 <= self.topk_groups <= self.n_groups:
                out.append(
                    f"topk_groups {self.topk_groups} must be between 1 and n_groups {self.n_groups}"
                )
            elif self.top_k > self.topk_groups * per_group:
                out.append(
                    f"top_k {self.top_k} exceeds the {self.topk_groups * per_group} "
                    "experts of topk_groups groups"
                )
        return out


@dataclass(frozen=True)
class MoETraining:
    """The token-dropping and router z-loss settings of a family's args (a base class of its
    args dataclass; the values come from its config section, titan.models.common.moe_options).
    Defaults: dropless, no z-loss."""

    moe_capacity_factor: float | None = None
    moe_drop_policy: str = "probs"
    moe_pad_to_capacity: bool = False
    moe_router_z_loss_coeff: float = 0.0

    def moe_training(self) -> dict:
        """These settings as MoEArgs fields."""
        return {
            "capacity_factor": self.moe_capacity_factor,
            "drop_policy": self.moe_drop_policy,
            "pad_to_capacity": self.moe_pad_to_capacity,
            "router_z_loss_coeff": self.moe_router_z_loss_coeff,
        }


@dataclass(frozen=True)
class SparseStepMoE(MoETraining):
    """Qwen's MoE layers (Qwen3-MoE, Qwen3-Next, Qwen3.5): routed experts in every
    decoder_sparse_step-th layer that is not in mlp_only_layers, balanced by the
    load-balancing loss (or the routing bias): their fields, once, for the args of those
    families (a base class listed before the args' param-count base). A dense flavor has no
    `moe`."""

    moe: MoEArgs | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the [family] options of the same names: Qwen's load-balancing loss coefficient (HF
    # router_aux_loss_coef), DeepSeek-V3's bias update rate (0: off), and the tokens of one
    # loss term (MoEArgs.aux_loss_scope)
    moe_aux_loss_coeff: float = 0.0
    moe_bias_update_rate: float = 0.0
    moe_aux_loss_scope: str = "sequence"
    # what a run may change without changing the model (titan.components.checkpoint.identity)
    training_knobs: ClassVar[tuple[str, ...]] = (*BALANCING_KNOBS, *TRAINING_KNOBS)

    def is_moe_layer(self, layer_id: int) -> bool:
        """transformers' rule for Qwen3MoeDecoderLayer and Qwen3NextDecoderLayer."""
        return (
            self.moe is not None
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def moe_layer_problems(self) -> list[str]:
        """What is wrong with the MoE settings, each naming its fields (empty: nothing, or a
        dense flavor)."""
        if self.moe is None:
            return []
        out = [f"moe: {p}" for p in self.moe_args().problems()]
        if self.decoder_sparse_step < 1:
            out.append(f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            out.append(f"mlp_only_layers {bad} are not layers of a {self.n_layers}-layer model")
        return out

    def moe_args(self) -> MoEArgs | None:
        """The MoE layers' settings with this run's balancing; None for a dense flavor."""
        if self.moe is None:
            return None
        rate = self.moe_bias_update_rate
        return replace(
            self.moe,
            score_bias=self.moe.score_bias or rate > 0,
            bias_update_rate=rate,
            aux_loss="load_balancing",
            aux_loss_coeff=self.moe_aux_loss_coeff,
            aux_loss_scope=self.moe_aux_loss_scope,
            **self.moe_training(),
        )
