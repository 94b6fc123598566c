"""Qwen3 and Qwen3-MoE hyper-parameters and the published flavors (a ModelArgs of
titan/models/spec.py). Shapes from the released configs: head_dim 128 in every size, whatever
dim / n_heads is; the FFN width given outright; tied embeddings up to 4B; the MoE sizes route
each token to 8 of 128 experts in every layer. Shared by the qwen3 and qwen3_vl families."""

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


# the columns of a size's row below
_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim")
# every released size was published for 40,960 positions
_RELEASED = dict(context_len=40960)


def _size(*shape: int, **rest) -> Qwen3Args:
    return Qwen3Args(**dict(zip(_SHAPE, shape, strict=True)), **rest)


# CPU-sized, with head_dim (32) twice dim / n_heads, as the real sizes have it too
_DEBUG = _size(256, 4, 16, 8, 768, head_dim=32, vocab_size=2048, tie_word_embeddings=True)


def _moe(hidden_dim: int) -> dict:
    # Qwen3-MoE: 8 of 128 experts in every layer, balanced at Qwen's coefficient
    experts = MoEArgs(n_experts=128, top_k=8, hidden_dim=hidden_dim)
    return dict(moe=experts, moe_aux_loss_coeff=0.001)


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": _DEBUG,
    # dim, layers, heads, key-value heads, FFN width; tied embeddings up to 4B
    "0.6B": _size(1024, 28, 16, 8, 3072, tie_word_embeddings=True, **_RELEASED),
    "1.7B": _size(2048, 28, 16, 8, 6144, tie_word_embeddings=True, **_RELEASED),
    "4B": _size(2560, 36, 32, 8, 9728, tie_word_embeddings=True, **_RELEASED),
    "8B": _size(4096, 36, 32, 8, 12288, **_RELEASED),
    "14B": _size(5120, 40, 40, 8, 17408, **_RELEASED),
    "32B": _size(5120, 64, 64, 8, 25600, **_RELEASED),
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
    "30B-A3B": _size(2048, 48, 32, 4, 6144, **_moe(768), **_RELEASED),
    "235B-A22B": _size(4096, 94, 64, 4, 12288, **_moe(1536), **_RELEASED),
}
