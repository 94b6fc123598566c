"""Qwen3 (dense) hyper-parameters and the published flavors (a ModelArgs of
titan/models/spec.py). Shapes from the released configs: head_dim 128 in every size, whatever
dim / n_heads is; the FFN width given outright; tied embeddings up to 4B."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Qwen3Args:
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

    def with_updates(self, **kw) -> "Qwen3Args":
        return replace(self, **kw)

    def num_params(self, include_embedding: bool = True) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2 + 2 * hd  # + q/k norms
        per_layer = attn + 3 * d * self.ffn_hidden_dim + 2 * d
        total = self.n_layers * per_layer + d + self.vocab_size * d  # final norm + output
        # a tied embedding is the output matrix: counted once, and its matmul is in FLOPs
        separate_embedding = include_embedding and not self.tie_word_embeddings
        return total + (self.vocab_size * d if separate_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul params plus attention scores over the full causal square (the PaLM /
        torchtitan convention), with Qwen3's own head_dim."""
        return 6 * self.num_params(include_embedding=False) + 12 * self.n_layers * self.n_heads * (
            self.head_dim * seq_len)


_TIED = dict(tie_word_embeddings=True, context_len=40960)
_UNTIED = dict(context_len=40960)

QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # CPU-sized, with head_dim (32) twice dim / n_heads, as the real sizes have it too
    "debugmodel": Qwen3Args(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32,
                            ffn_hidden_dim=768, vocab_size=2048, tie_word_embeddings=True),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072, **_TIED),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144, **_TIED),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728, **_TIED),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288, **_UNTIED),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408, **_UNTIED),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600, **_UNTIED),
}
