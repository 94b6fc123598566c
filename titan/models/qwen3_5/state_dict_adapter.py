"""Map titan's Qwen3.5 state dict and args to and from the HF hub layout of Qwen3.5's text
model (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`; also read from the released
vision-language checkpoints, whose decoder is `model.language_model.*`, their vision tower and
MTP layer left in the files).

titan's Qwen3.5 is the hybrid decoder of Qwen3-Next, so the mapping goes through Qwen3-Next's
hub layout (titan.models.common.hybrid_hf):
where Qwen3-Next fuses each key-head group's q, k, v, z rows (and b, a) into one projection,
Qwen3.5 stores all queries, then all keys, then all values (`in_proj_qkv`), and z, b and a
apart; the rows are reordered between the two (a tensor sharded across groups is gathered for
that one tensor). The routed experts are one tensor each of gate-and-up and down, as the hub
stores them; one tensor per expert (what a save_pretrained may write) is read too."""

import torch

from titan.models.common.hf_adapter import FusedExperts, on_whole
from titan.models.common.hybrid_args import HybridArgs
from titan.models.common.hybrid_hf import HybridHFAdapter, hybrid_args_from_hf_config
from titan.models.common.vision_hf import (
    VisionLanguageHF,
    mrope_of,
    vision_fields,
    vision_language_config,
)
from titan.models.qwen3_5.args import TEXT_FIELDS, Qwen3_5Args, mrope_sections

_QKVZ, _BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
_QKV, _Z, _B, _A = (f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
_TEXT, _MOE_TEXT = "qwen3_5_text", "qwen3_5_moe_text"


class Qwen3_5TextHF(HybridHFAdapter):
    """The text model's layout (a flavor with a tower: Qwen3_5StateDictAdapter)."""

    family = "Qwen3.5"
    section = "qwen3_5"
    hf_model_types = (_TEXT, _MOE_TEXT, "qwen3_5", "qwen3_5_moe")
    fused_expert_names = {
        "mlp.experts.gate_up_proj": FusedExperts(
            ("feed_forward.experts.w1", "feed_forward.experts.w3"), concatenated=True
        ),
        "mlp.experts.down_proj": FusedExperts(("feed_forward.experts.w2",)),
    }
    wrapped_prefixes = (("model.language_model.", "model."),)
    foreign_prefixes = ("model.visual.", "mtp.")

    def __init__(self, args: HybridArgs):
        super().__init__(args)
        a = args
        kd, vd, group = a.linear_k_dim, a.linear_v_dim, a.linear_v_heads // a.linear_k_heads
        width = 2 * kd + 2 * group * vd  # one key-head group's rows of in_qkvz
        g = torch.arange(a.linear_k_heads)[:, None] * width
        q = (g + torch.arange(kd)).flatten()
        v = (g + 2 * kd + torch.arange(group * vd)).flatten()
        # Qwen3-Next's grouped rows, in Qwen3.5's order: all q, all k, all v | all z
        self._qkvz = torch.cat([q, q + kd, v, v + group * vd])
        self._qkv_rows = 2 * a.linear_k_heads * kd + a.linear_v_heads * vd
        b = (torch.arange(a.linear_k_heads)[:, None] * 2 * group + torch.arange(group)).flatten()
        self._ba = torch.cat([b, b + group])  # all b | all a

    @classmethod
    def export_problems(cls, args: HybridArgs) -> list[str]:
        out = super().export_problems(args)
        if args.moe is not None:
            if args.mlp_only_layers or args.decoder_sparse_step != 1:
                out.append("Qwen3.5-MoE in the hub layout routes every layer (no dense layers)")
            if not args.moe.norm_topk_prob:
                out.append("Qwen3.5-MoE's router renormalizes the top-k weights")
        return out

    def to_hf(self, state_dict):
        out = super().to_hf(state_dict)
        for name in [n for n in out if n.endswith((_QKVZ, _BA))]:
            layer = name[: -len(_QKVZ)] if name.endswith(_QKVZ) else name[: -len(_BA)]
            t = out.pop(name)
            if name.endswith(_QKVZ):
                qkv, z = _rows(t, self._qkvz, [self._qkv_rows, len(self._qkvz) - self._qkv_rows])
                out[layer + _QKV], out[layer + _Z] = qkv, z
            else:
                half = len(self._ba) // 2
                out[layer + _B], out[layer + _A] = _rows(t, self._ba, [half, half])
        return out

    def from_hf(self, hf_state_dict, hf_config=None):
        state = dict(hf_state_dict)
        for name in [n for n in state if n.endswith(_QKV)]:
            layer = name[: -len(_QKV)]
            pieces = [state.pop(layer + p) for p in (_QKV, _Z)]
            state[layer + _QKVZ] = _rows(pieces, torch.argsort(self._qkvz), None)
            pieces = [state.pop(layer + p) for p in (_B, _A)]
            state[layer + _BA] = _rows(pieces, torch.argsort(self._ba), None)
        return super().from_hf(state, hf_config)

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> Qwen3_5Args:
        return qwen3_5_args_from_hf_config(config, max_seq_len)

    def hf_config(self) -> dict:
        cfg = super().hf_config()
        a = self.args
        moe = a.moe is not None
        for key in ("partial_rotary_factor", "rope_theta", "decoder_sparse_step"):
            cfg.pop(key)
        cfg.pop("mlp_only_layers")
        cfg.pop("norm_topk_prob")
        if moe:
            cfg.pop("intermediate_size")
        else:
            for key in [k for k in cfg if "expert" in k or k == "router_aux_loss_coef"]:
                cfg.pop(key)
        # text-only positions are equal in mRoPE's three sections: plain RoPE
        cfg.update(
            architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            model_type=_MOE_TEXT if moe else _TEXT,
            attn_output_gate=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": a.rope_theta,
                "partial_rotary_factor": a.rotary_dim / a.head_dim,
                "mrope_section": list(a.mrope_section),
                "mrope_interleaved": True,
            },
        )
        return cfg


class Qwen3_5StateDictAdapter(VisionLanguageHF, Qwen3_5TextHF):
    """Qwen3.5's hub layouts: the text model's (`Qwen3_5ForCausalLM`), or with the vision
    tower `Qwen3_5ForConditionalGeneration`'s (titan.models.common.vision_hf)."""

    def hf_config(self) -> dict:
        text = super().hf_config()
        a = self.args
        if a.vision is None:
            return text
        kind = "qwen3_5_moe" if a.moe is not None else "qwen3_5"
        architecture = (
            "Qwen3_5MoeForConditionalGeneration" if a.moe else "Qwen3_5ForConditionalGeneration"
        )
        return vision_language_config(a, architecture, kind, text, f"{kind}_vision")


def _rows(w, order: torch.Tensor, sizes: list[int] | None):
    """Rows of `w` (or of its `pieces` stacked, when a list) taken in `order`: cut into
    `sizes` (a list) or whole (None); sharded as they were (hf_adapter.on_whole)."""
    pieces = w if isinstance(w, list) else [w]

    def take(*whole):
        out = torch.cat(whole).index_select(0, order.to(whole[0].device))
        return out if sizes is None else out.split(sizes)

    return on_whole(take, *pieces)


def qwen3_5_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> Qwen3_5Args:
    """Map an HF Qwen3.5 config (the text model's, or a vision-language model's with its
    text_config and vision_config) to Qwen3_5Args; ValueError naming every field titan
    cannot express."""
    text = config.get("text_config")
    c = dict(text) if isinstance(text, dict) else dict(config)
    if "tie_word_embeddings" not in c and "tie_word_embeddings" in config:
        c["tie_word_embeddings"] = config["tie_word_embeddings"]
    kind = c.get("model_type") or config.get("model_type")
    problems = []
    if kind not in Qwen3_5StateDictAdapter.hf_model_types:
        problems.append(f"model_type={kind!r} is not a Qwen3.5 model")
    if kind in ("qwen3_5_moe", _MOE_TEXT) or c.get("num_experts"):
        # every layer routed, the top-k weights renormalized: not settings of Qwen3.5's
        c.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    else:
        c["num_experts"] = 0
    vision = vision_fields(config, c["hidden_size"], problems)
    base = hybrid_args_from_hf_config(c, max_seq_len, "Qwen3.5", problems)
    fields = {k: getattr(base, k) for k in TEXT_FIELDS}
    section = mrope_of(c, mrope_sections(base.rotary_dim))
    return Qwen3_5Args(**fields, **vision, mrope_section=section)
