"""Hyper-parameters of the hybrid linear-attention decoder (titan.models.common.hybrid_decoder;
a ModelArgs of titan/models/spec.py) of Qwen3-Next and Qwen3.5: three of every four layers mix
tokens with Gated DeltaNet (linear attention), the fourth with gated full attention (an output
gate, RoPE on part of each head); each FFN a SwiGLU or a mixture of experts beside a gated
shared expert; norms zero-centred (scale 1 + w, w decayed towards 0). Defaults: the released
Qwen3-Next-80B-A3B's."""

from dataclasses import dataclass, replace

from titan.models.common.moe_args import SparseStepMoE
from titan.models.common.param_count import DecoderParamCount


@dataclass(frozen=True)
class HybridArgs(SparseStepMoE, DecoderParamCount):
    dim: int = 2048
    n_layers: int = 48
    # gated full attention (every full_attention_interval-th layer)
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    rotary_dim: int = 64  # RoPE on the first rotary_dim dims of each head (HF: head_dim x 0.25)
    full_attention_interval: int = 4
    # Gated DeltaNet (the other layers)
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    conv_kernel: int = 4
    ffn_hidden_dim: int = 5120  # the dense layers' SwiGLU (none in the released model)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 4096
    # the context the model was published for (HF max_position_embeddings); None: max_seq_len
    context_len: int | None = None
    tie_word_embeddings: bool = False
    # SparseStepMoE's routed experts sit beside a shared SwiGLU of this width, whose output a
    # sigmoid gates
    shared_expert_dim: int = 512

    def with_updates(self, **kw) -> "HybridArgs":
        return replace(self, **kw)

    def is_linear_layer(self, layer_id: int) -> bool:
        """transformers' layer_types: full attention in every interval-th layer."""
        return (layer_id + 1) % self.full_attention_interval != 0

    def problems(self) -> list[str]:
        out = []
        if self.linear_v_heads % self.linear_k_heads:
            out.append(
                f"linear_v_heads {self.linear_v_heads} is not a multiple of linear_k_heads "
                f"{self.linear_k_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            out.append(f"rotary_dim {self.rotary_dim} must be even and at most head_dim")
        if self.full_attention_interval < 1:
            out.append(f"full_attention_interval {self.full_attention_interval} must be >= 1")
        return out + self.moe_layer_problems()

    def layout_problems(self, dims) -> list[str]:
        # tensor parallelism splits the linear layers by key-head groups; context parallelism
        # splits each rank's groups again (its linear layers run whole sequences by heads)
        split = dims.tp * dims.cp
        if self.linear_k_heads % split:
            return [
                f"tensor_parallel_degree {dims.tp} x context_parallel_degree {dims.cp} must "
                f"divide linear_k_heads {self.linear_k_heads} (a rank holds whole key-head "
                "groups of Gated DeltaNet)"
            ]
        return []

    def _linear_params(self) -> int:
        d, kh, vh, kd, vd = (
            self.dim,
            self.linear_k_heads,
            self.linear_v_heads,
            self.linear_k_dim,
            self.linear_v_dim,
        )
        projections = d * (2 * kh * kd + 2 * vh * vd) + d * 2 * vh + vh * vd * d
        conv = (2 * kh * kd + vh * vd) * self.conv_kernel
        return projections + conv + 2 * vh + vd  # + dt_bias, A_log, the gated norm

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        return (
            d * self.n_heads * hd * 2
            + d * self.n_kv_heads * hd * 2
            + self.n_heads * hd * d
            + 2 * hd
        )

    def layer_params(self, layer_id: int, active: bool = False) -> int:
        d = self.dim
        mixer = (
            self._linear_params() if self.is_linear_layer(layer_id) else self._attention_params()
        )
        if self.is_moe_layer(layer_id):
            shared = 3 * d * self.shared_expert_dim + d  # + its gate
            ffn = self.moe.layer_params(d, active) + shared
        else:
            ffn = 3 * d * self.ffn_hidden_dim
        return mixer + 2 * d + ffn

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the matmul parameters a token uses, the full-attention layers' scores over the
        causal square (the PaLM / torchtitan convention), and the linear layers' recurrence:
        per value head, the state's read and rank-one write, 2 x 2 x k_dim x v_dim forward,
        three times that with backward."""
        linear = sum(self.is_linear_layer(i) for i in range(self.n_layers))
        full = self.n_layers - linear
        state = 12 * self.linear_v_heads * self.linear_k_dim * self.linear_v_dim
        return (
            6 * self.num_params(include_embedding=False, active=True)
            + 12 * full * self.n_heads * self.head_dim * seq_len
            + linear * state
        )


# CPU-sized, the shape of the families' debug flavors: 4 layers (3 linear, 1 full)
HYBRID_DEBUG = HybridArgs(
    dim=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=2,
    head_dim=64,
    rotary_dim=16,
    linear_k_heads=4,
    linear_v_heads=8,
    linear_k_dim=32,
    linear_v_dim=32,
    ffn_hidden_dim=768,
    vocab_size=2048,
)


def check_context_parallel_type(job, plan) -> None:
    """Gated DeltaNet under context parallelism runs whole sequences, 1/cp of the heads a
    rank: the hybrid type's all-to-all groups hold only part of each sequence (a plan check
    of every family built on HybridArgs)."""
    from titan.config.manager import require

    require(
        job,
        not isinstance(plan.model_args, HybridArgs)
        or not plan.dims.cp_enabled
        or job.parallelism.context_parallel_type != "hybrid",
        "parallelism.context_parallel_type",
        f"{job.model.name}'s Gated DeltaNet (linear layers need each sequence whole in an "
        "all-to-all group); use 'ring' or 'alltoall'",
    )
