"""Qwen3 and Qwen3-MoE hyper-parameters and the published flavors (a ModelArgs of
titan/models/spec.py). Shapes from the released configs: head_dim 128 in every size, whatever
dim / n_heads is; the FFN width given outright; tied embeddings up to 4B; the MoE sizes route
each token to 8 of 128 experts in every layer."""

from dataclasses import dataclass, replace

from titan.models.common.moe_args import MoEArgs, SparseStepMoE
from titan.models.common.param_count import DecoderParamCount


@dataclass(frozen=True)
class Qwen3Args(SparseStepMoE, DecoderParamCount):
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
    # Qwen3-MoE: SparseStepMoE's experts replace the FFN of its layers (ffn_hidden_dim is
    # then the width of the dense ones)

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


# CPU-sized, with head_dim (32) twice dim / n_heads, as the real sizes have it too
_DEBUG = Qwen3Args(
    dim=256,
    n_layers=4,
    n_heads=16,
    n_kv_heads=8,
    head_dim=32,
    ffn_hidden_dim=768,
    vocab_size=2048,
    tie_word_embeddings=True,
)


def _released(dim, n_layers, n_heads, n_kv_heads, ffn_hidden_dim, **rest) -> Qwen3Args:
    # every released size was published for 40,960 positions
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_hidden_dim=ffn_hidden_dim,
        context_len=40960,
        **rest,
    )


def _moe(hidden_dim: int) -> dict:
    # Qwen3-MoE: 8 of 128 experts in every layer, balanced at Qwen's coefficient
    experts = MoEArgs(n_experts=128, top_k=8, hidden_dim=hidden_dim)
    return dict(moe=experts, moe_aux_loss_coeff=0.001)


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": _DEBUG,
    # dim, layers, heads, key-value heads, FFN width; tied embeddings up to 4B
    "0.6B": _released(1024, 28, 16, 8, 3072, tie_word_embeddings=True),
    "1.7B": _released(2048, 28, 16, 8, 6144, tie_word_embeddings=True),
    "4B": _released(2560, 36, 32, 8, 9728, tie_word_embeddings=True),
    "8B": _released(4096, 36, 32, 8, 12288),
    "14B": _released(5120, 40, 40, 8, 17408),
    "32B": _released(5120, 64, 64, 8, 25600),
    # Qwen3-MoE. The debug model keeps a dense first layer (mlp_only_layers) to exercise both
    # kinds of block; the load-balancing loss is on at Qwen's coefficient, as in the released
    # configs' router_aux_loss_coef
    "debugmodel_moe": replace(
        _DEBUG,
        tie_word_embeddings=False,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=128),
        mlp_only_layers=(0,),
        moe_aux_loss_coeff=0.001,
    ),
    # the same, then the experts' width
    "30B-A3B": _released(2048, 48, 32, 4, 6144, **_moe(768)),
    "235B-A22B": _released(4096, 94, 64, 4, 12288, **_moe(1536)),
}
