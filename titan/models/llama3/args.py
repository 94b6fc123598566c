"""Llama 3 hyper-parameters and the published flavors (a ModelArgs of titan/models/spec.py)."""

from dataclasses import dataclass, replace

from titan.models.common.param_count import DecoderParamCount


@dataclass(frozen=True)
class Llama3Args(DecoderParamCount):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 long-context frequency scaling; None keeps plain RoPE
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_seq_len: int = 2048
    # the context the model was published for (HF max_position_embeddings); None: max_seq_len
    context_len: int | None = None
    # one matrix for the embedding and the output projection (Llama 3.2 1B/3B)
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:  # plain multi-head attention
            object.__setattr__(self, "n_kv_heads", self.n_heads)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_updates(self, **kw) -> "Llama3Args":
        return replace(self, **kw)

    def layer_params(self, layer_id: int, active: bool = False) -> int:
        """One block's parameters (`active`, those one token uses, is every one: dense)."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        return attn + 3 * d * self.ffn_hidden_dim + 2 * d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params (forward+backward) plus attention scores.

        The attention term 12*L*H*Dh*T counts QK^T and AV over the full causal square,
        the convention PaLM's MFU and torchtitan use, so figures compare across projects.
        """
        return 6 * self.num_params(include_embedding=False) + 12 * self.n_layers * self.n_heads * (
            self.head_dim * seq_len
        )


_LLAMA31_ROPE = dict(
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=8192,
    context_len=131072,
)
_LLAMA32 = dict(_LLAMA31_ROPE, rope_scaling_factor=32.0, tie_word_embeddings=True)

_DEBUG = Llama3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048)
# the columns of a released size's row below (every one has 8 key-value heads)
_SHAPE = ("dim", "n_layers", "n_heads", "ffn_dim_multiplier", "multiple_of")


def _released(*shape, rope: dict) -> Llama3Args:
    return Llama3Args(**dict(zip(_SHAPE, shape, strict=True)), n_kv_heads=8, **rope)


LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": _DEBUG,
    # the debug model with Llama 3.2's tied embedding, to try that path on a laptop
    "debugmodel_tied": replace(_DEBUG, tie_word_embeddings=True),
    # dim, layers, heads, FFN multiplier, multiple_of, RoPE scaling (Llama 3.2 / 3.1)
    "1B": _released(2048, 16, 32, 1.5, 256, rope=_LLAMA32),
    "3B": _released(3072, 28, 24, 1.0, 256, rope=_LLAMA32),
    "8B": _released(4096, 32, 32, 1.3, 1024, rope=_LLAMA31_ROPE),
    "70B": _released(8192, 80, 64, 1.3, 4096, rope=_LLAMA31_ROPE),
    "405B": _released(16384, 126, 128, 1.2, 4096, rope=_LLAMA31_ROPE),
}
