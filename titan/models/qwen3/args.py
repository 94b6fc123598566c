"""Qwen3 and Qwen3-MoE hyper-parameters and the published flavors (a ModelArgs of
titan/models/spec.py). Shapes from the released configs: head_dim 128 in every size, whatever
dim / n_heads is; the FFN width given outright; tied embeddings up to 4B; the MoE sizes route
each token to 8 of 128 experts in every layer."""

from dataclasses import dataclass, replace
from typing import ClassVar

from titan.models.common.moe_args import (
    BALANCING_KNOBS,
    TRAINING_KNOBS,
    MoEArgs,
    MoETraining,
    SparseStepMoE,
)
from titan.models.common.param_count import DecoderParamCount


@dataclass(frozen=True)
class Qwen3Args(SparseStepMoE, DecoderParamCount, MoETraining):
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_hidden_dim: int = 12288
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # YaRN context extension (Qwen3's published recipe for 128k); None keeps plain RoPE
    rope_scaling_factor: float | None = None
    rope_original_max_len: int = 32768
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    max_seq_len: int = 4096
    # the context the model was published for (HF max_position_embeddings); None: max_seq_len
    context_len: int | None = None
    tie_word_embeddings: bool = False
    # Qwen3-MoE: routed experts instead of the FFN in every decoder_sparse_step-th layer that
    # is not in mlp_only_layers (ffn_hidden_dim is then the width of those dense layers)
    moe: MoEArgs | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # balancing (the [qwen3] options of the same names): Qwen3-MoE's load-balancing loss
    # coefficient (HF router_aux_loss_coef), and DeepSeek-V3's bias update rate (0: off)
    moe_aux_loss_coeff: float = 0.0
    moe_bias_update_rate: float = 0.0
    moe_aux_loss_scope: str = "sequence"  # the tokens of one loss term (MoEArgs.aux_loss_scope)
    # what a run may change without changing the model (titan.components.checkpoint.identity)
    training_knobs: ClassVar[tuple[str, ...]] = (*BALANCING_KNOBS, *TRAINING_KNOBS)

    def with_updates(self, **kw) -> "Qwen3Args":
        return replace(self, **kw)

    def upcycled(self, n_experts: int, top_k: int, granularity: int = 1) -> "Qwen3Args":
        """Qwen3-MoE with experts in every layer (Qwen's softmax router, the k weights
        renormalized) and Qwen's balancing coefficient."""
        moe = MoEArgs(n_experts, top_k, hidden_dim=self.ffn_hidden_dim // granularity)
        return replace(
            self, moe=moe, mlp_only_layers=(), decoder_sparse_step=1, moe_aux_loss_coeff=0.001
        )

    def problems(self) -> list[str]:
        """What is wrong with these settings, each naming its fields (empty: nothing)."""
        return self.moe_layer_problems()

    def layer_params(self, layer_id: int, active: bool = False) -> int:
        """One block's parameters; `active`: those one token uses (top_k routed experts)."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2 + 2 * hd  # + q/k norms
        ffn = (
            self.moe.layer_params(d, active)
            if self.is_moe_layer(layer_id)
            else 3 * d * self.ffn_hidden_dim
        )
        return attn + 2 * d + ffn

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the matmul parameters a token uses (its routed experts only) plus attention
        scores over the full causal square (the PaLM / torchtitan convention), with Qwen3's
        own head_dim."""
        return 6 * self.num_params(include_embedding=False, active=True) + (
            12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        )


_TIED = dict(tie_word_embeddings=True, context_len=40960)
_UNTIED = dict(context_len=40960)

QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # CPU-sized, with head_dim (32) twice dim / n_heads, as the real sizes have it too
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=16,
        n_kv_heads=8,
        head_dim=32,
        ffn_hidden_dim=768,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072, **_TIED
    ),
    "1.7B": Qwen3Args(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144, **_TIED
    ),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728, **_TIED),
    "8B": Qwen3Args(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288, **_UNTIED
    ),
    "14B": Qwen3Args(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408, **_UNTIED
    ),
    "32B": Qwen3Args(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600, **_UNTIED
    ),
    # Qwen3-MoE. The debug model keeps a dense first layer (mlp_only_layers) to exercise both
    # kinds of block; the load-balancing loss is on at Qwen's coefficient, as in the released
    # configs' router_aux_loss_coef
    "debugmodel_moe": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=16,
        n_kv_heads=8,
        head_dim=32,
        ffn_hidden_dim=768,
        vocab_size=2048,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=128),
        mlp_only_layers=(0,),
        moe_aux_loss_coeff=0.001,
    ),
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_hidden_dim=6144,
        moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=768),
        moe_aux_loss_coeff=0.001,
        **_UNTIED,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        ffn_hidden_dim=12288,
        moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=1536),
        moe_aux_loss_coeff=0.001,
        **_UNTIED,
    ),
}
