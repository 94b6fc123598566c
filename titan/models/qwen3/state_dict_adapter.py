"""Map titan's Qwen3 state dict and args to and from the HF `Qwen3ForCausalLM` hub layout.
Both rotate the two halves of each head, so weights cross as they are: renamed, not permuted."""

from titan.models.common.hf_adapter import DecoderHFAdapter, rope_settings
from titan.models.qwen3.args import Qwen3Args

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


class Qwen3StateDictAdapter(DecoderHFAdapter):
    family = "Qwen3"
    hf_model_type = "qwen3"
    layer_names = _LAYER

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> Qwen3Args:
        return qwen3_args_from_hf_config(config, max_seq_len)

    def hf_config(self) -> dict:
        a = self.args
        cfg = {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": a.dim, "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
            "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
            "max_position_embeddings": a.context_len or a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, "torch_dtype": "float32",
        }
        if a.rope_scaling_factor is not None:
            cfg["rope_scaling"] = {
                "rope_type": "yarn", "factor": a.rope_scaling_factor,
                "original_max_position_embeddings": a.rope_original_max_len,
                "beta_fast": a.rope_beta_fast, "beta_slow": a.rope_beta_slow,
            }
        return cfg


def qwen3_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> Qwen3Args:
    """Map an HF Qwen3 config (transformers 4.x or 5.x layout) to Qwen3Args. Raises
    ValueError naming every field titan's Qwen3 cannot express.

    `max_seq_len` (titan's RoPE table length) defaults to max_position_embeddings."""
    c = dict(config)
    problems = []
    model_type, archs = c.get("model_type"), c.get("architectures") or []
    if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
        problems.append(f"model_type={model_type!r} / architectures={archs} is not a dense "
                        "Qwen3 model")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (titan uses SwiGLU with silu)")
    if c.get("attention_bias"):
        problems.append("attention_bias=true (titan's projections have no bias)")
    if c.get("use_sliding_window"):
        problems.append("use_sliding_window=true (titan's Qwen3 attends to the whole context)")
    n_heads = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads") or n_heads
    if n_heads % n_kv:
        problems.append(f"num_attention_heads={n_heads} not a multiple of num_key_value_heads={n_kv}")
    rope_theta, rope_type, rope, rope_problems = rope_settings(c)
    problems += rope_problems
    yarn = {}
    if rope_type == "yarn":
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                problems.append(f"YaRN {key} (titan uses YaRN's default temperature)")
        yarn = {"rope_scaling_factor": float(rope["factor"]),
                "rope_original_max_len": int(rope.get("original_max_position_embeddings")
                                             or c.get("max_position_embeddings")),
                "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
                "rope_beta_slow": float(rope.get("beta_slow") or 1.0)}
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (titan's Qwen3 implements plain RoPE and YaRN)")
    if problems:
        raise ValueError("unsupported HF config for titan's Qwen3: " + "; ".join(problems))
    seq_len = int(max_seq_len or c.get("max_position_embeddings", 4096))
    context = c.get("max_position_embeddings")
    return Qwen3Args(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        ffn_hidden_dim=c["intermediate_size"], vocab_size=c["vocab_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        max_seq_len=seq_len, context_len=None if context == seq_len else context,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), **yarn)
