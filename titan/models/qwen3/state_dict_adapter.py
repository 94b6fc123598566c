"""Qwen3's hub layout lives in titan.models.common.qwen3_hf (Qwen3-VL's text model is
Qwen3's): imported from here as before."""

from titan.models.common.qwen3_hf import Qwen3StateDictAdapter, qwen3_args_from_hf_config

__all__ = ["Qwen3StateDictAdapter", "qwen3_args_from_hf_config"]
