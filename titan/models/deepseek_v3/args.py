"""DeepSeek-V3 hyper-parameters and the published flavors (a ModelArgs of
titan/models/spec.py): multi-head latent attention, YaRN RoPE on the rotary part of each head,
dense first layers, then sigmoid-routed experts with shared experts. Shapes from the released
configs (DeepSeek-V3, and Moonlight-16B-A3B, the DeepSeek-V3 architecture at 16B)."""

from dataclasses import dataclass, replace
from typing import ClassVar

from titan.models.common.moe_args import BALANCING_KNOBS, TRAINING_KNOBS, MoEArgs, MoETraining
from titan.models.common.param_count import DecoderParamCount


@dataclass(frozen=True)
class DeepSeekV3Args(DecoderParamCount, MoETraining):
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    ffn_hidden_dim: int = 18432  # the SwiGLU width of the dense layers
    n_dense_layers: int = 3  # HF first_k_dense_replace: the first layers have no experts
    # multi-head latent attention: queries through a rank-q_lora_rank bottleneck (0: a plain
    # projection), keys and values through one of kv_lora_rank; each head's query and key are
    # a part without position (qk_nope_head_dim) and a rotated part (qk_rope_head_dim) whose
    # key is shared by every head
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    moe: MoEArgs | None = MoEArgs(
        n_experts=256,
        top_k=8,
        hidden_dim=2048,
        score_func="sigmoid",
        n_groups=8,
        topk_groups=4,
        route_scale=2.5,
        score_bias=True,
        n_shared_experts=1,
    )
    rope_theta: float = 10000.0
    # YaRN (None: plain RoPE); the softmax scale grows by yarn_mscale(factor,
    # rope_mscale_all_dim)^2 and the rotation by the ratio of the two mscales, as HF does
    rope_scaling_factor: float | None = None
    rope_original_max_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    # the rotary part pairs dimensions (2i, 2i+1), as DeepSeek's checkpoints do (HF
    # rope_interleave); False: the two halves
    interleaved_rope: bool = True
    max_seq_len: int = 4096
    # the context the model was published for (HF max_position_embeddings); None: max_seq_len
    context_len: int | None = None
    tie_word_embeddings: bool = False
    # balancing (the [deepseek_v3] options of the same names), DeepSeek-V3's published values:
    # the sequence-wise balance loss coefficient (alpha) and the bias update rate (gamma)
    moe_aux_loss_coeff: float = 0.0001
    moe_bias_update_rate: float = 0.001
    moe_aux_loss_scope: str = "sequence"  # the sequence-wise loss (MoEArgs.aux_loss_scope)
    # multi-token prediction (titan.models.deepseek_v3.mtp): this many extra depths, each
    # one more block predicting one token further (HF num_nextn_predict_layers; 0: off),
    # their mean loss weighted by mtp_loss_weight (DeepSeek-V3: 0.3 early, 0.1 later)
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # what a run may change without changing the model (titan.components.checkpoint.identity)
    training_knobs: ClassVar[tuple[str, ...]] = (
        *BALANCING_KNOBS,
        *TRAINING_KNOBS,
        "mtp_loss_weight",
    )
    training_blocks: ClassVar[str | None] = "mtp_depth"

    def with_updates(self, **kw) -> "DeepSeekV3Args":
        return replace(self, **kw)

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # every head has its own key and value, expanded from the latent

    @property
    def head_dim(self) -> int:
        """The width of a query or key head (the value's is v_head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.n_dense_layers

    def moe_args(self) -> MoEArgs | None:
        """The MoE layers' settings with this run's balancing; None without routed experts."""
        if self.moe is None:
            return None
        return replace(
            self.moe,
            bias_update_rate=self.moe_bias_update_rate,
            aux_loss="deepseek",
            aux_loss_coeff=self.moe_aux_loss_coeff,
            aux_loss_scope=self.moe_aux_loss_scope,
            **self.moe_training(),
        )

    def problems(self) -> list[str]:
        """What is wrong with these settings, each naming its fields (empty: nothing)."""
        out = [f"moe: {p}" for p in self.moe_args().problems()] if self.moe else []
        if not 0 <= self.n_dense_layers <= self.n_layers:
            out.append(
                f"n_dense_layers {self.n_dense_layers} must be between 0 and n_layers "
                f"{self.n_layers}"
            )
        if self.q_lora_rank < 0 or self.kv_lora_rank < 1:
            out.append(
                f"q_lora_rank {self.q_lora_rank} must be >= 0 (0: no query bottleneck) "
                f"and kv_lora_rank {self.kv_lora_rank} >= 1"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim < 2:
            out.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotated in pairs)")
        if self.mtp_depth < 0:
            out.append(f"mtp_depth {self.mtp_depth} must be >= 0 (0: no multi-token prediction)")
        if self.mtp_loss_weight < 0:
            out.append(f"mtp_loss_weight {self.mtp_loss_weight} must be >= 0")
        return out

    def layout_problems(self, dims) -> list[str]:
        if self.mtp_depth and dims.cp > 1:
            return [
                f"context_parallel_degree {dims.cp} with mtp_depth {self.mtp_depth}: a "
                "prediction depth reads the tokens after each position, which context "
                "parallelism puts on other ranks; set deepseek_v3.mtp_depth = 0 or "
                "parallelism.context_parallel_degree = 1"
            ]
        return []

    def block_count(self) -> int:
        return self.n_layers + self.mtp_depth

    def masked_labels_problem(self) -> str | None:
        if not self.mtp_depth:
            return None
        return (
            f"mtp_depth {self.mtp_depth}: a prediction depth reads the next tokens from the "
            "labels, where a masked token (a prompt's) has no id; set deepseek_v3.mtp_depth = 0"
        )

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """The main model's, plus each prediction depth's block, merging projection and two
        norms (its embedding and output head are the main model's)."""
        d = self.dim
        depth = self.layer_params(self.n_layers, active) + 2 * d * d + 3 * d
        return super().num_params(include_embedding, active) + self.mtp_depth * depth

    def attention_params(self) -> int:
        d, h, q = self.dim, self.n_heads, self.q_lora_rank
        query = d * q + q + q * h * self.head_dim if q else d * h * self.head_dim
        kv = (
            d * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return query + kv + h * self.v_head_dim * d

    def layer_params(self, layer_id: int, active: bool = False) -> int:
        """One block's parameters; `active`: those one token uses (top_k routed experts)."""
        d = self.dim
        ffn = (
            self.moe.layer_params(d, active)
            if self.is_moe_layer(layer_id)
            else 3 * d * self.ffn_hidden_dim
        )
        return self.attention_params() + 2 * d + ffn

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the matmul parameters a token uses plus attention over the full causal square
        (the PaLM / torchtitan convention): scores over query/key heads of head_dim, the
        weighted sum over values of v_head_dim."""
        # each prediction depth: its block (in num_params) and one more pass of the output head
        return (
            6
            * (
                self.num_params(include_embedding=False, active=True)
                + self.mtp_depth * self.vocab_size * self.dim
            )
            + 6
            * (self.n_layers + self.mtp_depth)
            * self.n_heads
            * (self.head_dim + self.v_head_dim)
            * seq_len
        )


DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # CPU-sized, with every part of the big one: a query bottleneck, MLA, one dense layer,
    # 8 routed experts in 4 groups (2 of them kept per token), top 2, one shared expert
    "debugmodel": DeepSeekV3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        vocab_size=2048,
        ffn_hidden_dim=768,
        n_dense_layers=1,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe=MoEArgs(
            n_experts=8,
            top_k=2,
            hidden_dim=128,
            score_func="sigmoid",
            n_groups=4,
            topk_groups=2,
            route_scale=2.5,
            score_bias=True,
            n_shared_experts=1,
        ),
    ),
    # Moonlight-16B-A3B: DeepSeek-V3's architecture at DeepSeek-V2-Lite's shape (no query
    # bottleneck, 64 experts, 6 per token, 2 shared), in the deepseek_v3 hub layout
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=163840,
        norm_eps=1e-5,
        ffn_hidden_dim=11264,
        n_dense_layers=1,
        q_lora_rank=0,
        moe=MoEArgs(
            n_experts=64,
            top_k=6,
            hidden_dim=1408,
            score_func="sigmoid",
            route_scale=2.446,
            score_bias=True,
            n_shared_experts=2,
        ),
        rope_theta=50000.0,
        context_len=8192,
    ),
    "671B": DeepSeekV3Args(
        rope_scaling_factor=40.0, rope_mscale=1.0, rope_mscale_all_dim=1.0, context_len=163840
    ),
}
