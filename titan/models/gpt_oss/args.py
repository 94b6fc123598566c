"""GPT-OSS hyper-parameters and the published flavors (a ModelArgs of titan/models/spec.py):
grouped-query attention with biases and a learned sink logit per head, layers alternating a
sliding window with full attention, YaRN RoPE, and experts in every layer (biases, a clamped
SwiGLU, softmax over the top-k router logits). Shapes from the released configs of
openai/gpt-oss-20b and gpt-oss-120b."""

from dataclasses import dataclass, replace
from typing import ClassVar

from titan.models.common.moe_args import BALANCING_KNOBS, TRAINING_KNOBS, MoEArgs, MoETraining
from titan.models.common.param_count import DecoderParamCount

SLIDING, FULL = "sliding_attention", "full_attention"  # HF layer_types


@dataclass(frozen=True)
class GptOssArgs(DecoderParamCount, MoETraining):
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    # every layer's experts; top-k softmax = a softmax over all scores renormalized on the k
    moe: MoEArgs = MoEArgs(n_experts=32, top_k=4, hidden_dim=2880)
    # the experts' activation: (up + 1) x gate x sigmoid(alpha x gate), gate clamped above
    # and up on both sides at swiglu_limit
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # each layer's attention (HF layer_types); None: sliding first, then alternating
    layer_types: tuple[str, ...] | None = None
    sliding_window: int = 128
    rope_theta: float = 150000.0
    # YaRN as released: factor 32 over 4096 positions, its correction range not rounded
    # (HF rope_parameters.truncate = false); None: plain RoPE
    rope_scaling_factor: float | None = 32.0
    rope_original_max_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    max_seq_len: int = 4096
    context_len: int | None = 131072
    tie_word_embeddings: bool = False
    # balancing (the [gpt_oss] options of the same names): the load-balancing loss weight
    # (HF router_aux_loss_coef) and the tokens of one loss term
    moe_aux_loss_coeff: float = 0.001
    moe_aux_loss_scope: str = "sequence"
    training_knobs: ClassVar[tuple[str, ...]] = (*BALANCING_KNOBS, *TRAINING_KNOBS)

    def with_updates(self, **kw) -> "GptOssArgs":
        return replace(self, **kw)

    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.n_layers))

    def window(self, layer_id: int) -> int | None:
        return self.sliding_window if self.kinds()[layer_id] == SLIDING else None

    def is_moe_layer(self, layer_id: int) -> bool:
        return True

    def moe_args(self) -> MoEArgs:
        return replace(
            self.moe,
            aux_loss="load_balancing",
            aux_loss_coeff=self.moe_aux_loss_coeff,
            aux_loss_scope=self.moe_aux_loss_scope,
            **self.moe_training(),
        )

    def problems(self) -> list[str]:
        out = [f"moe: {p}" for p in self.moe_args().problems()]
        kinds = self.kinds()
        if len(kinds) != self.n_layers:
            out.append(f"layer_types names {len(kinds)} layers of a {self.n_layers}-layer model")
        odd = sorted(set(kinds) - {SLIDING, FULL})
        if odd:
            out.append(f"layer_types {odd} are not {SLIDING!r} or {FULL!r}")
        if self.sliding_window < 1:
            out.append(f"sliding_window {self.sliding_window} must be >= 1")
        if self.swiglu_limit <= 0:
            out.append(f"swiglu_limit {self.swiglu_limit} must be > 0")
        return out

    def layer_params(self, layer_id: int, active: bool = False) -> int:
        """Attention (with biases and a sink per head), two norms and the experts: router
        weight and bias, each expert's three matrices and three biases."""
        d, hd, h, kv = self.dim, self.head_dim, self.n_heads, self.n_kv_heads
        attn = 2 * (d * h * hd) + 2 * (d * kv * hd) + h * hd + 2 * kv * hd + d + h
        m = self.moe
        expert = 3 * d * m.hidden_dim + 2 * m.hidden_dim + d
        routed = m.top_k if active else m.n_experts
        return attn + 2 * d + (d + 1) * m.n_experts + routed * expert

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the matmul parameters a token uses plus attention scores, each sliding layer
        over its window rather than the causal square."""
        attended = sum(
            min(seq_len, w) if (w := self.window(i)) is not None else seq_len
            for i in range(self.n_layers)
        )
        return 6 * self.num_params(include_embedding=False, active=True) + (
            12 * attended * self.n_heads * self.head_dim
        )


GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    # CPU-sized: 2 sliding and 2 full layers, a window of 16 (a quarter of the tests' 64
    # tokens, so that it masks), released YaRN, biases and sinks, 8 experts top-2
    "debugmodel": GptOssArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=2048,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=128),
        sliding_window=16,
        context_len=None,
    ),
    "20b": GptOssArgs(),
    "120b": GptOssArgs(n_layers=36, moe=MoEArgs(n_experts=128, top_k=4, hidden_dim=2880)),
}
