"""Qwen3's model lives in titan.models.common.qwen3_decoder (Qwen3-VL's text model is
Qwen3's): imported from here as before."""

from titan.models.common.qwen3_decoder import Qwen3, rope_cache

__all__ = ["Qwen3", "rope_cache"]
