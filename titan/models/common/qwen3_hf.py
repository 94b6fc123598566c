"""Map titan's Qwen3 state dict and args to and from the HF hub layout of
`Qwen3ForCausalLM` and `Qwen3MoeForCausalLM`. Both rotate the two halves of each head, so
weights cross as they are: renamed, not permuted; the routed experts are split per expert.
Shared by the qwen3 and qwen3_vl families."""

from titan.models.common.hf_adapter import (
    BLOCK_NAMES,
    ROUTER_NAMES,
    SWIGLU_EXPERT_NAMES,
    DecoderHFAdapter,
    gqa_heads,
    rope_settings,
    sparse_moe_fields,
    sparse_step_moe_hf_fields,
    yarn_fields,
)
from titan.models.common.qwen3_args import Qwen3Args

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **BLOCK_NAMES,
    **ROUTER_NAMES,
}
_NO_BIAS = (
    "Qwen3-MoE in the hub layout has no routing bias: export a run trained with "
    "qwen3.moe_bias_update_rate = 0, or keep the DCP checkpoint"
)


class Qwen3StateDictAdapter(DecoderHFAdapter):
    family = "Qwen3"
    hf_model_types = ("qwen3", "qwen3_moe")
    layer_names = _LAYER
    expert_names = SWIGLU_EXPERT_NAMES

    @classmethod
    def export_problems(cls, args: Qwen3Args) -> list[str]:
        """Why these args cannot be written in the hub layout (empty: they can)."""
        return [_NO_BIAS] if args.moe is not None and args.moe_bias_update_rate else []

    def to_hf(self, state_dict):
        if any(name.endswith("router.expert_bias") for name in state_dict):
            raise ValueError(_NO_BIAS)
        return super().to_hf(state_dict)

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> Qwen3Args:
        return qwen3_args_from_hf_config(config, max_seq_len)

    def hf_config(self) -> dict:
        a = self.args
        cfg = self.decoder_hf_config("Qwen3ForCausalLM", "qwen3", use_sliding_window=False)
        if a.rope_scaling_factor is not None:
            cfg["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": a.rope_scaling_factor,
                "original_max_position_embeddings": a.rope_original_max_len,
                "beta_fast": a.rope_beta_fast,
                "beta_slow": a.rope_beta_slow,
            }
        if a.moe is not None:
            cfg.update(sparse_step_moe_hf_fields(a))
            cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        return cfg


def qwen3_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> Qwen3Args:
    """Map an HF Qwen3 config (transformers 4.x or 5.x layout) to Qwen3Args. Raises
    ValueError naming every field titan's Qwen3 cannot express.

    `max_seq_len` (titan's RoPE table length) defaults to max_position_embeddings."""
    c = dict(config)
    problems = []
    model_type, archs = c.get("model_type"), c.get("architectures") or []
    moe = model_type == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs
    if not moe and model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
        problems.append(
            f"model_type={model_type!r} / architectures={archs} is not a Qwen3 or Qwen3-MoE model"
        )
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (titan uses SwiGLU with silu)")
    if c.get("attention_bias"):
        problems.append("attention_bias=true (titan's projections have no bias)")
    if c.get("use_sliding_window"):
        problems.append("use_sliding_window=true (titan's Qwen3 attends to the whole context)")
    n_heads, n_kv = gqa_heads(c, problems)
    rope_theta, rope_type, rope, rope_problems = rope_settings(c)
    problems += rope_problems
    yarn = {}
    if rope_type == "yarn":
        yarn = yarn_fields(rope, c, problems)
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (titan's Qwen3 implements plain RoPE and YaRN)")
    moe_fields = sparse_moe_fields(c, problems) if moe else {}
    if problems:
        raise ValueError("unsupported HF config for titan's Qwen3: " + "; ".join(problems))
    seq_len = int(max_seq_len or c.get("max_position_embeddings", 4096))
    context = c.get("max_position_embeddings")
    return Qwen3Args(
        **moe_fields,
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        ffn_hidden_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_seq_len=seq_len,
        context_len=None if context == seq_len else context,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        **yarn,
    )
