"""Qwen3's args and flavors live in titan.models.common.qwen3_args (Qwen3-VL's text model is
Qwen3's): imported from here as before."""

from titan.models.common.qwen3_args import QWEN3_FLAVORS, Qwen3Args

__all__ = ["QWEN3_FLAVORS", "Qwen3Args"]
