"""Map titan's DeepSeek-V3 state dict and args to and from the HF hub layout of
`DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi K2, Moonlight). Its checkpoints rotate interleaved
pairs as titan does (rope_interleave), so weights cross renamed, not permuted; the routed
experts are split per expert; the routing bias is HF's e_score_correction_bias."""

import re

from titan.models.common.hf_adapter import (
    BLOCK_NAMES,
    LEAVE_OUT,
    ROUTER_NAMES,
    SWIGLU_EXPERT_NAMES,
    DecoderHFAdapter,
    rope_settings,
)
from titan.models.common.moe_args import MoEArgs
from titan.models.deepseek_v3.args import DeepSeekV3Args

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    **BLOCK_NAMES,
    **ROUTER_NAMES,
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    # a multi-token-prediction depth's own parts (titan.models.deepseek_v3.mtp)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
}
# what the hub stores in every prediction depth's layer as a copy of the main model's
_MTP_COPIES = {"embed_tokens.weight": "mtp_embeddings.weight", "shared_head.head.weight": None}
_HF_LAYER_ID = re.compile(r"^model\.layers\.(\d+)\.")


class DeepSeekV3StateDictAdapter(DecoderHFAdapter):
    family = "DeepSeek-V3"
    hf_model_types = ("deepseek_v3", "kimi_k2")
    layer_names = _LAYER
    expert_names = SWIGLU_EXPERT_NAMES

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> DeepSeekV3Args:
        return deepseek_v3_args_from_hf_config(config, max_seq_len)

    def to_hf(self, state_dict):
        """The hub layout; each prediction depth's layer also gets the copies of the embedding
        and output head the released checkpoints store in it (copied: a file holds no two
        names of one storage; read back, from_hf keeps one of them)."""
        state = dict(state_dict)
        # a checkpoint's state names the depths' copy as its owner (the embedding)
        embedding = state.pop("mtp_embeddings.weight", state.get("tok_embeddings.weight"))
        out = super().to_hf(state)
        for k in range(self.args.mtp_depth):
            layer = f"model.layers.{self.args.n_layers + k}"
            if embedding is not None:
                out[f"{layer}.embed_tokens.weight"] = embedding.detach().clone()
            if "output.weight" in state:
                out[f"{layer}.shared_head.head.weight"] = state["output.weight"].detach().clone()
        return out

    def from_hf(self, hf_state_dict, hf_config=None):
        # the hub stores the multi-token-prediction depths as layers past the decoder's
        # (num_nextn_predict_layers of them): titan reads as many as mtp_depth asks (none:
        # skipped, as transformers skips them), each depth's copies of the shared embedding
        # and head once
        n, depth = self.args.n_layers, self.args.mtp_depth
        kept, embedding = {}, None
        for name, t in hf_state_dict.items():
            m = _HF_LAYER_ID.match(name)
            if m is None or int(m[1]) < n:
                kept[name] = t
                continue
            if int(m[1]) >= n + depth:
                if depth or (hf_config or {}).get("num_nextn_predict_layers"):
                    continue
                kept[name] = t  # a layer of neither: let the renaming name it
                continue
            rest = name[m.end() :]
            if rest in _MTP_COPIES:
                if _MTP_COPIES[rest] is not None and embedding is None:
                    embedding = t
                continue
            kept[name] = t
        out = super().from_hf(kept, hf_config)
        if embedding is not None:
            # one matrix: the main embedding where this state holds it (a pipeline's last
            # stage holds only the depths' copy)
            out["mtp_embeddings.weight"] = out.get("tok_embeddings.weight", embedding)
        return out

    def hf_config(self) -> dict:
        a = self.args
        m = a.moe or MoEArgs()
        cfg = self.decoder_hf_config(
            "DeepseekV3ForCausalLM",
            "deepseek_v3",
            num_key_value_heads=a.n_heads,
            head_dim=LEAVE_OUT,
            q_lora_rank=a.q_lora_rank or None,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            rope_interleave=a.interleaved_rope,
            first_k_dense_replace=a.n_dense_layers if a.moe else a.n_layers,
            n_routed_experts=m.n_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=m.hidden_dim,
            n_shared_experts=m.n_shared_experts,
            n_group=m.n_groups,
            topk_group=m.topk_groups,
            routed_scaling_factor=m.route_scale,
            norm_topk_prob=m.norm_topk_prob,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_layer_freq=1,
            num_nextn_predict_layers=a.mtp_depth,
        )
        if a.rope_scaling_factor is not None:
            cfg["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": a.rope_scaling_factor,
                "original_max_position_embeddings": a.rope_original_max_len,
                "beta_fast": a.rope_beta_fast,
                "beta_slow": a.rope_beta_slow,
                "mscale": a.rope_mscale,
                "mscale_all_dim": a.rope_mscale_all_dim,
            }
        return cfg


def _unsupported(c: dict) -> list[str]:
    """The settings of an HF DeepSeek-V3 config titan's cannot express, each named."""
    problems = []
    model_type, archs = c.get("model_type"), c.get("architectures") or []
    if (
        model_type not in DeepSeekV3StateDictAdapter.hf_model_types
        and "DeepseekV3ForCausalLM" not in archs
    ):
        problems.append(
            f"model_type={model_type!r} / architectures={archs} is not a DeepSeek-V3 model"
        )
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (titan uses SwiGLU with silu)")
    if c.get("attention_bias"):
        problems.append("attention_bias=true (titan's projections have no bias)")
    n_heads = int(c["num_attention_heads"])
    if int(c.get("num_key_value_heads") or n_heads) != n_heads:
        problems.append(
            "num_key_value_heads != num_attention_heads (MLA expands a key and value per head)"
        )
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(
            f"scoring_func={c['scoring_func']!r} (DeepSeek-V3 scores experts with a sigmoid)"
        )
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method={c['topk_method']!r} (titan routes as noaux_tc)")
    if int(c.get("moe_layer_freq", 1)) != 1:
        problems.append(
            f"moe_layer_freq={c['moe_layer_freq']} (every layer after "
            "first_k_dense_replace is an MoE layer)"
        )
    return problems


def _yarn(c: dict, rope_type: str, rope: dict) -> tuple[dict, list[str]]:
    """The YaRN fields of DeepSeekV3Args ({} for plain RoPE), and what cannot be expressed."""
    if rope_type == "default":
        return {}, []
    if rope_type != "yarn":
        return {}, [f"rope type {rope_type!r} (titan's DeepSeek-V3 implements plain RoPE and YaRN)"]
    problems = []
    if rope.get("attention_factor") is not None:
        problems.append("YaRN attention_factor (titan derives it from mscale and mscale_all_dim)")
    yarn = {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_original_max_len": int(
            rope.get("original_max_position_embeddings") or c.get("max_position_embeddings")
        ),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_mscale": float(rope.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }
    return yarn, problems


def _routing(c: dict, n_layers: int) -> tuple[MoEArgs | None, list[str]]:
    """The routed experts (None: a dense model), and what cannot be expressed of them."""
    n_experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    if not n_experts or int(c.get("first_k_dense_replace") or 0) >= n_layers:
        return None, []
    moe = MoEArgs(
        n_experts=n_experts,
        top_k=int(c.get("num_experts_per_tok") or 1),
        hidden_dim=int(c["moe_intermediate_size"]),
        score_func="sigmoid",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        n_groups=int(c.get("n_group") or 1),
        topk_groups=int(c.get("topk_group") or 1),
        route_scale=float(c.get("routed_scaling_factor") or 1.0),
        score_bias=True,
        n_shared_experts=int(c.get("n_shared_experts") or 0),
    )
    what = "(n_routed_experts / num_experts_per_tok / n_group / topk_group)"
    return moe, [f"{p} {what}" for p in moe.problems()]


def deepseek_v3_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> DeepSeekV3Args:
    """Map an HF DeepSeek-V3 config (transformers 4.x or 5.x layout) to DeepSeekV3Args. Raises
    ValueError naming every field titan's DeepSeek-V3 cannot express.

    `max_seq_len` (titan's RoPE table length) defaults to max_position_embeddings. The balancing
    settings are not in the hub layout: the flavor's defaults (DeepSeek-V3's) apply."""
    c = dict(config)
    problems = _unsupported(c)
    rope_theta, rope_type, rope, rope_problems = rope_settings(c)
    yarn, yarn_problems = _yarn(c, rope_type, rope)
    n_layers = int(c["num_hidden_layers"])
    moe, moe_problems = _routing(c, n_layers)
    problems += rope_problems + yarn_problems + moe_problems
    n_heads = int(c["num_attention_heads"])
    dense = int(c.get("first_k_dense_replace") or 0)
    seq_len = int(max_seq_len or c.get("max_position_embeddings", 4096))
    context = c.get("max_position_embeddings")
    args = DeepSeekV3Args(
        dim=int(c["hidden_size"]),
        n_layers=n_layers,
        n_heads=n_heads,
        vocab_size=int(c["vocab_size"]),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        ffn_hidden_dim=int(c["intermediate_size"]),
        n_dense_layers=min(dense, n_layers),
        q_lora_rank=int(c.get("q_lora_rank") or 0),
        kv_lora_rank=int(c["kv_lora_rank"]),
        qk_nope_head_dim=int(c["qk_nope_head_dim"]),
        qk_rope_head_dim=int(c["qk_rope_head_dim"]),
        v_head_dim=int(c["v_head_dim"]),
        moe=moe,
        rope_theta=rope_theta,
        interleaved_rope=bool(c.get("rope_interleave", True)),
        max_seq_len=seq_len,
        context_len=None if context == seq_len else context,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        mtp_depth=int(c.get("num_nextn_predict_layers") or 0),
        **yarn,
    )
    problems += [p for p in args.problems() if not p.startswith("moe:")]
    if problems:
        raise ValueError("unsupported HF config for titan's DeepSeek-V3: " + "; ".join(problems))
    return args
