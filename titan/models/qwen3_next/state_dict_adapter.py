"""Qwen3-Next's hub layout (`Qwen3NextForCausalLM`): the hybrid decoder's own
(titan.models.common.hybrid_hf)."""

from titan.models.common.hybrid_args import HybridArgs
from titan.models.common.hybrid_hf import HybridHFAdapter, hybrid_args_from_hf_config


class Qwen3NextStateDictAdapter(HybridHFAdapter):
    family = "Qwen3-Next"
    section = "qwen3_next"
    hf_model_types = ("qwen3_next",)
    hf_architecture = "Qwen3NextForCausalLM"

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> HybridArgs:
        return qwen3_next_args_from_hf_config(config, max_seq_len)


def qwen3_next_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> HybridArgs:
    """Map an HF Qwen3-Next config to HybridArgs; ValueError naming every field titan's
    Qwen3-Next cannot express."""
    c = dict(config)
    problems = []
    if c.get("model_type") != "qwen3_next" and "Qwen3NextForCausalLM" not in (
        c.get("architectures") or []
    ):
        problems.append(f"model_type={c.get('model_type')!r} is not a Qwen3-Next model")
    return hybrid_args_from_hf_config(c, max_seq_len, "Qwen3-Next", problems)
