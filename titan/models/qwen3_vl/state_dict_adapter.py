"""Map titan's Qwen3-VL to and from the hub layout of `Qwen3VLForConditionalGeneration` and
`Qwen3VLMoeForConditionalGeneration`: the text model as Qwen3's (under
`model.language_model.`), the tower under `model.visual.` (titan.models.common.vision_hf), the
MoE flavors' experts one tensor each of gate-and-up and down, as the hub stores them."""

import dataclasses

from titan.models.common.hf_adapter import FusedExperts
from titan.models.common.qwen3_hf import Qwen3StateDictAdapter, qwen3_args_from_hf_config
from titan.models.common.vision_hf import (
    VisionLanguageHF,
    mrope_of,
    vision_fields,
    vision_language_config,
)
from titan.models.qwen3_vl.args import Qwen3VLArgs


class Qwen3VLStateDictAdapter(VisionLanguageHF, Qwen3StateDictAdapter):
    family = "Qwen3-VL"
    hf_model_types = ("qwen3_vl", "qwen3_vl_moe")
    wrapped_prefixes = (("model.language_model.", "model."),)
    fused_expert_names = {
        "mlp.experts.gate_up_proj": FusedExperts(
            ("feed_forward.experts.w1", "feed_forward.experts.w3"), concatenated=True
        ),
        "mlp.experts.down_proj": FusedExperts(("feed_forward.experts.w2",)),
    }

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> Qwen3VLArgs:
        return qwen3_vl_args_from_hf_config(config, max_seq_len)

    def hf_config(self) -> dict:
        a = self.args
        text = super().hf_config()
        kind = "qwen3_vl_moe" if a.moe is not None else "qwen3_vl"
        for key in ("rope_theta", "rope_scaling", "use_sliding_window"):
            text.pop(key, None)
        text.update(
            model_type=f"{kind}_text",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": a.rope_theta,
                "mrope_section": list(a.mrope_section),
                "mrope_interleaved": True,
            },
        )
        architecture = (
            "Qwen3VLMoeForConditionalGeneration" if a.moe else "Qwen3VLForConditionalGeneration"
        )
        return vision_language_config(a, architecture, kind, text, kind)


def qwen3_vl_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> Qwen3VLArgs:
    """An HF Qwen3-VL (or -MoE) config as Qwen3VLArgs; ValueError naming every field titan
    cannot express."""
    c = dict(config)
    kind = c.get("model_type")
    if kind not in Qwen3VLStateDictAdapter.hf_model_types or "text_config" not in c:
        raise ValueError(
            f"unsupported HF config for titan's Qwen3-VL: model_type={kind!r} is not a "
            "Qwen3-VL model with a text_config"
        )
    text_config = c["text_config"]
    text = dict(text_config)
    problems = []
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not rope.get("mrope_interleaved", True):
        problems.append("mrope_interleaved=false (titan's mRoPE interleaves the sections)")
    moe = kind == "qwen3_vl_moe"
    text.update(
        model_type="qwen3_moe" if moe else "qwen3",
        architectures=[],
        rope_parameters={k: v for k, v in rope.items() if not k.startswith("mrope")},
        tie_word_embeddings=c.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
    )
    try:
        base = qwen3_args_from_hf_config(text, max_seq_len)
    except ValueError as e:
        problems.append(str(e).split(": ", 1)[-1])
        base = None
    vision = vision_fields(c, text["hidden_size"], problems)
    if problems:
        raise ValueError("unsupported HF config for titan's Qwen3-VL: " + "; ".join(problems))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return Qwen3VLArgs(**fields, **vision, mrope_section=mrope_of(text_config, (24, 20, 20)))
