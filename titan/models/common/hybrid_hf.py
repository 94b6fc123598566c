"""Map the hybrid decoder's (titan.models.common.hybrid_decoder) state dict and args to and
from the HF hub layout of `Qwen3NextForCausalLM`, which a family of it names as its own or
converts further (Qwen3.5). titan keeps that layout's (the gated query projection, the linear
layers' grouped projections and the convolution's channel order; zero-centred norm weights),
so weights cross renamed, the convolution's (channels, kernel) gaining the hub's middle dim."""

from titan.models.common.hf_adapter import (
    BLOCK_NAMES,
    ROUTER_NAMES,
    SWIGLU_EXPERT_NAMES,
    DecoderHFAdapter,
    gqa_heads,
    rope_settings,
    sparse_moe_fields,
    sparse_step_moe_hf_fields,
)
from titan.models.common.hybrid_args import HybridArgs

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.in_qkvz.weight": "linear_attn.in_proj_qkvz.weight",
    "attention.in_ba.weight": "linear_attn.in_proj_ba.weight",
    "attention.conv": "linear_attn.conv1d.weight",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention.A_log": "linear_attn.A_log",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.out.weight": "linear_attn.out_proj.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_experts.gate.weight": "mlp.shared_expert_gate.weight",
    **BLOCK_NAMES,
    **ROUTER_NAMES,
}


class HybridHFAdapter(DecoderHFAdapter):
    """A family sets `family`, `section` (its model.name), `hf_model_types` (the first is
    what an export writes), `hf_architecture` and `args_from_hf_config`."""

    section = ""
    hf_architecture = ""
    layer_names = _LAYER
    expert_names = SWIGLU_EXPERT_NAMES

    @classmethod
    def _no_bias(cls) -> str:
        return (
            f"{cls.family} in the hub layout has no routing bias: export a run trained with "
            f"{cls.section}.moe_bias_update_rate = 0, or keep the DCP checkpoint"
        )

    @classmethod
    def export_problems(cls, args: HybridArgs) -> list[str]:
        return [cls._no_bias()] if args.moe is not None and args.moe_bias_update_rate else []

    def to_hf(self, state_dict):
        if any(name.endswith("router.expert_bias") for name in state_dict):
            raise ValueError(self._no_bias())
        out = super().to_hf(state_dict)
        for name, t in out.items():
            if name.endswith("conv1d.weight"):
                out[name] = t.unsqueeze(1)  # (channels, 1, kernel): a depthwise Conv1d's
        return out

    def from_hf(self, hf_state_dict, hf_config=None):
        squeezed = {
            k: v.squeeze(1) if k.endswith("conv1d.weight") else v for k, v in hf_state_dict.items()
        }
        return super().from_hf(squeezed, hf_config)

    def hf_config(self) -> dict:
        a = self.args
        return self.decoder_hf_config(
            self.hf_architecture,
            self.hf_model_types[0],
            partial_rotary_factor=a.rotary_dim / a.head_dim,
            full_attention_interval=a.full_attention_interval,
            layer_types=[
                "linear_attention" if a.is_linear_layer(i) else "full_attention"
                for i in range(a.n_layers)
            ],
            linear_num_key_heads=a.linear_k_heads,
            linear_num_value_heads=a.linear_v_heads,
            linear_key_head_dim=a.linear_k_dim,
            linear_value_head_dim=a.linear_v_dim,
            linear_conv_kernel_dim=a.conv_kernel,
            shared_expert_intermediate_size=a.shared_expert_dim,
            **sparse_step_moe_hf_fields(a),
        )


def hybrid_args_from_hf_config(
    c: dict, max_seq_len: int | None, family: str, problems: list[str]
) -> HybridArgs:
    """The HybridArgs of a Qwen3-Next-style text config (`c`'s fields as Qwen3-Next names
    them) for `family`; ValueError naming `problems` and every field titan cannot express."""
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (titan uses SwiGLU with silu)")
    if c.get("attention_bias"):
        problems.append("attention_bias=true (titan's projections have no bias)")
    if c.get("attn_output_gate") is False:
        problems.append("attn_output_gate=false (titan's full attention is gated)")
    n_heads, n_kv = gqa_heads(c, problems)
    rope_theta, rope_type, rope, rope_problems = rope_settings(c)
    # a partial rotation is this family's own (rotary_dim below)
    problems += [p for p in rope_problems if not p.startswith("partial_rotary_factor")]
    if rope_type != "default":
        problems.append(f"rope type {rope_type!r} (titan's {family} implements plain RoPE)")
    n_layers = int(c["num_hidden_layers"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // n_heads)
    factor = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
    interval = int(c.get("full_attention_interval", 4))
    types = c.get("layer_types")
    expected = [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
    ]
    if types is not None and list(types) != expected:
        problems.append(
            "layer_types other than full attention in every full_attention_interval-th layer"
        )
    moe_fields = _moe_fields(c, problems)
    if problems:
        raise ValueError(f"unsupported HF config for titan's {family}: " + "; ".join(problems))
    seq_len = int(max_seq_len or c.get("max_position_embeddings", 4096))
    context = c.get("max_position_embeddings")
    dense = c.get("intermediate_size")
    return HybridArgs(
        **moe_fields,
        dim=c["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rotary_dim=int(head_dim * factor),
        full_attention_interval=interval,
        linear_k_heads=int(c["linear_num_key_heads"]),
        linear_v_heads=int(c["linear_num_value_heads"]),
        linear_k_dim=int(c["linear_key_head_dim"]),
        linear_v_dim=int(c["linear_value_head_dim"]),
        conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
        # an all-MoE config (Qwen3.5's) may have no dense width: titan's default, unused
        **({} if dense is None else {"ffn_hidden_dim": int(dense)}),
        vocab_size=c["vocab_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_seq_len=seq_len,
        context_len=None if context == seq_len else context,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _moe_fields(c: dict, problems: list[str]) -> dict:
    fields = sparse_moe_fields(c, problems, norm_topk_prob=True)
    if fields:
        fields["shared_expert_dim"] = int(c.get("shared_expert_intermediate_size", 0))
    return fields
