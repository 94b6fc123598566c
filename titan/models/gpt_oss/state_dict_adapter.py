"""Map titan's GPT-OSS state dict and args to and from the HF hub layout of
`GptOssForCausalLM`: attention renamed (both rotate the two halves of each head), the sinks
and router as they are, and each layer's experts in four tensors for all of them
(`gate_up_proj` with gate and up columns alternating, each expert's matrix stored (in, out)).
The released checkpoints store the expert matrices in MXFP4: titan.models.gpt_oss.mxfp4
dequantizes such a folder first."""

from titan.models.common.hf_adapter import (
    BLOCK_NAMES,
    LEAVE_OUT,
    DecoderHFAdapter,
    FusedExperts,
    gqa_heads,
    rope_settings,
    yarn_fields,
)
from titan.models.common.moe_args import MoEArgs
from titan.models.gpt_oss.args import FULL, SLIDING, GptOssArgs

_EXPERTS = "feed_forward.experts."
_LAYER = {
    **{f"attention.w{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
    "attention.wo.weight": BLOCK_NAMES["attention.wo.weight"],
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": BLOCK_NAMES["attention_norm.weight"],
    "ffn_norm.weight": BLOCK_NAMES["ffn_norm.weight"],
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
}
_FUSED = {
    "mlp.experts.gate_up_proj": FusedExperts((_EXPERTS + "w1", _EXPERTS + "w3"), transposed=True),
    "mlp.experts.gate_up_proj_bias": FusedExperts((_EXPERTS + "b1", _EXPERTS + "b3")),
    "mlp.experts.down_proj": FusedExperts((_EXPERTS + "w2",), transposed=True),
    "mlp.experts.down_proj_bias": FusedExperts((_EXPERTS + "b2",)),
}


class GptOssStateDictAdapter(DecoderHFAdapter):
    family = "GPT-OSS"
    hf_model_types = ("gpt_oss",)
    layer_names = _LAYER
    fused_expert_names = _FUSED

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> GptOssArgs:
        return gpt_oss_args_from_hf_config(config, max_seq_len)

    def hf_config(self) -> dict:
        a = self.args
        rope = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.rope_scaling_factor is not None:
            rope.update(
                {
                    "rope_type": "yarn",
                    "factor": a.rope_scaling_factor,
                    "original_max_position_embeddings": a.rope_original_max_len,
                    "beta_fast": a.rope_beta_fast,
                    "beta_slow": a.rope_beta_slow,
                    "truncate": a.rope_truncate,
                }
            )
        return self.decoder_hf_config(
            "GptOssForCausalLM",
            "gpt_oss",
            intermediate_size=a.moe.hidden_dim,
            rope_theta=LEAVE_OUT,
            rope_parameters=rope,
            attention_bias=True,
            attention_dropout=0.0,
            num_local_experts=a.moe.n_experts,
            num_experts_per_tok=a.moe.top_k,
            swiglu_limit=a.swiglu_limit,
            swiglu_alpha=a.swiglu_alpha,
            sliding_window=a.sliding_window,
            layer_types=list(a.kinds()),
            # transformers adds the loss only with output_router_logits, as released
            router_aux_loss_coef=a.moe_aux_loss_coeff,
            output_router_logits=False,
        )


def gpt_oss_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> GptOssArgs:
    """Map an HF GPT-OSS config to GptOssArgs. Raises ValueError naming every field titan's
    GPT-OSS cannot express, and for a folder of MXFP4 weights the command that dequantizes it.

    `max_seq_len` (titan's RoPE table length) defaults to max_position_embeddings."""
    c = dict(config)
    problems = []
    if c.get("model_type") != "gpt_oss" and "GptOssForCausalLM" not in (
        c.get("architectures") or []
    ):
        problems.append(f"model_type={c.get('model_type')!r} is not a GPT-OSS model")
    quant = (c.get("quantization_config") or {}).get("quant_method")
    if quant is not None:
        how = (
            "dequantize it with `python -m titan.models.gpt_oss.mxfp4 SRC DST`"
            if quant == "mxfp4"
            else "titan reads float weights only"
        )
        problems.append(f"quantization_config.quant_method={quant!r}: {how}")
    if c.get("attention_bias", True) is not True:
        problems.append("attention_bias=false (GPT-OSS's projections have biases)")
    n_heads, n_kv = gqa_heads(c, problems)
    rope_theta, rope_type, rope, rope_problems = rope_settings(c)
    problems += rope_problems
    yarn = {"rope_scaling_factor": None}
    if rope_type == "yarn":
        yarn = {
            **yarn_fields(rope, c, problems),
            "rope_truncate": bool(rope.get("truncate", True)),
        }
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (titan's GPT-OSS implements plain RoPE and YaRN)")
    n_layers = int(c["num_hidden_layers"])
    kinds = tuple(
        c.get("layer_types") or (SLIDING if i % 2 == 0 else FULL for i in range(n_layers))
    )
    moe = MoEArgs(
        n_experts=int(c.get("num_local_experts", c.get("num_experts", 0))),
        top_k=int(c.get("num_experts_per_tok", 1)),
        hidden_dim=int(c["intermediate_size"]),
    )
    seq_len = int(max_seq_len or c.get("max_position_embeddings", 4096))
    context = c.get("max_position_embeddings")
    args = GptOssArgs(
        dim=c["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        vocab_size=c["vocab_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        moe=moe,
        swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        layer_types=None if kinds == GptOssArgs(n_layers=n_layers).kinds() else kinds,
        sliding_window=int(c.get("sliding_window") or 128),
        rope_theta=rope_theta,
        max_seq_len=seq_len,
        context_len=None if context == seq_len else context,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.001)),
        **yarn,
    )
    problems += [f"{p} (num_local_experts / num_experts_per_tok)" for p in moe.problems()]
    problems += [p for p in args.problems() if not p.startswith("moe:")]
    if problems:
        raise ValueError("unsupported HF config for titan's GPT-OSS: " + "; ".join(problems))
    return args
