"""Map titan's Llama 3 state dict and args to and from the HF `LlamaForCausalLM` layout.

titan rotates interleaved pairs (Meta's layout); HF rotates the two halves of each head,
so q/k projection rows are permuted on the way across (titan.models.common.hf_adapter).
"""

import math

from titan.models.common.hf_adapter import BLOCK_NAMES, DecoderHFAdapter, gqa_heads, rope_settings
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    **BLOCK_NAMES,
}


class Llama3StateDictAdapter(DecoderHFAdapter):
    family = "Llama 3"
    hf_model_types = ("llama",)
    layer_names = _LAYER  # a variant family overrides it
    interleaved_rope = True

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> Llama3Args:
        return llama3_args_from_hf_config(config, max_seq_len)

    def hf_config(self) -> dict:
        a = self.args
        cfg = self.decoder_hf_config("LlamaForCausalLM", "llama", mlp_bias=False)
        if a.rope_scaling_factor is not None:
            cfg["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_len,
            }
        return cfg


def _ffn_args(dim: int, intermediate: int) -> dict:
    """(multiple_of, ffn_dim_multiplier) that reproduce HF's intermediate_size exactly."""
    for flavor in LLAMA3_FLAVORS.values():  # the published Llama 3 choices first
        if flavor.dim == dim and flavor.ffn_hidden_dim == intermediate:
            return {
                "multiple_of": flavor.multiple_of,
                "ffn_dim_multiplier": flavor.ffn_dim_multiplier,
            }
    hidden = int(2 * 4 * dim / 3)
    if intermediate >= hidden:
        for m in (4096, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
            if m * ((hidden + m - 1) // m) == intermediate:
                return {"multiple_of": m, "ffn_dim_multiplier": None}
    # any width: int(mult * hidden) == intermediate with multiple_of=1
    mult = intermediate / hidden
    for _ in range(4):
        if int(mult * hidden) == intermediate:
            return {"multiple_of": 1, "ffn_dim_multiplier": mult}
        mult = math.nextafter(mult, math.inf)
    raise ValueError(f"cannot express intermediate_size={intermediate} for dim={dim}")


def llama3_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> Llama3Args:
    """Map an HF Llama config (transformers 4.x `rope_scaling` or 5.x `rope_parameters`
    layout) to Llama3Args. Raises ValueError for what titan's Llama cannot express.

    `max_seq_len` (titan's RoPE table length) defaults to max_position_embeddings.
    """
    c = dict(config)
    problems = []
    model_type = c.get("model_type")
    archs = c.get("architectures") or []
    if model_type != "llama" and "LlamaForCausalLM" not in archs:
        problems.append(f"model_type={model_type!r} / architectures={archs} is not a Llama model")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (titan uses SwiGLU with silu)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            problems.append(f"{key}=true (titan's projections have no bias)")
    dim, n_heads = c["hidden_size"], c["num_attention_heads"]
    if dim % n_heads:
        problems.append(f"hidden_size={dim} is not a multiple of num_attention_heads={n_heads}")
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        problems.append(
            f"head_dim={head_dim} != hidden_size/num_attention_heads={dim // n_heads} "
            "(titan derives head_dim)"
        )
    _, n_kv = gqa_heads(c, problems)

    rope_theta, rope_type, rope, rope_problems = rope_settings(c)
    problems += rope_problems
    scaling = {}
    if rope_type == "llama3":
        scaling = {
            "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
            "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
            "rope_original_max_len": int(
                rope.get("original_max_position_embeddings", c.get("max_position_embeddings", 8192))
            ),
        }
    elif rope_type != "default":
        problems.append(
            f"rope type {rope_type!r} (titan implements plain RoPE and 'llama3' scaling)"
        )
    if problems:
        raise ValueError("unsupported HF config for titan's Llama 3: " + "; ".join(problems))

    # long-context (scaled RoPE) models publish their context; plain-RoPE ones are used at
    # the length they are trained at
    context = c.get("max_position_embeddings") if scaling else None
    args = Llama3Args(
        context_len=context,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        dim=dim,
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=c["vocab_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_seq_len=int(max_seq_len or c.get("max_position_embeddings", 2048)),
        **_ffn_args(dim, c["intermediate_size"]),
        **scaling,
    )
    assert args.ffn_hidden_dim == c["intermediate_size"] and args.head_dim == dim // n_heads
    return args
