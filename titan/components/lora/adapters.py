"""LoRA: low-rank adapters on a model's linear layers, the base weights frozen (the [lora]
section).

A target layer computes x W^T + (alpha / r) (x A^T) B^T with A (r, in) and B (out, r) its own
parameters `lora_a` and `lora_b`, beside `weight`, so every base weight keeps its name and
checkpoints, HF loads and the parallelisms find it where they did. The swap happens on the
meta-device model before any parallelism, as float8's does; tensor parallelism places the
factors to match the weight (`low_rank_factors`). B starts at zero (the model starts as the
base model) and A from a generator seeded by its name, as every titan weight is, so every
layout starts from the same adapters.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.init import seeded_init_
from titan.parallelisms.activation_checkpoint import recomputed_in_backward

# wrappers the parallelisms put between a model and its blocks: not part of a canonical name
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update; made by `add_adapter`, not constructed."""

    # (down, up): the factors tensor parallelism places after the weight it updates
    low_rank_factors = ("lora_a", "lora_b")
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        # a rank-r product costs r/in of the layer's to recompute: per-op AC keeps nothing
        with recomputed_in_backward():
            h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
            return out + self.lora_scale * F.linear(F.linear(h, self.lora_a), self.lora_b)


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Turn `linear` into a LoRALinear in place (on whatever device it is)."""
    weight = linear.weight
    linear.__class__ = LoRALinear
    linear.lora_scale, linear.lora_dropout = alpha / rank, dropout
    make = dict(device=weight.device, dtype=weight.dtype)
    linear.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, **make))
    linear.lora_b = nn.Parameter(torch.empty(linear.out_features, rank, **make))
    weight.requires_grad_(False)
    if linear.bias is not None:
        linear.bias.requires_grad_(False)


def apply_lora(model: nn.Module, cfg) -> list[str]:
    """Adapters on the linear layers `cfg` (the lora section) targets; every other parameter
    frozen. Returns the adapted layers' names; raises ValueError when none is targeted or a
    target is no plain linear layer."""
    patterns = [re.compile(p) for p in cfg.target_modules]
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if name and any(p.search(name) for p in patterns)
    ]
    odd = [f"{n} ({type(m).__name__})" for n, m in targets if type(m) is not nn.Linear]
    if odd:
        raise ValueError(
            f"lora.target_modules {cfg.target_modules} match {', '.join(odd[:3])}: adapters go on "
            "plain linear layers; narrow the regexes (end them with $)"
        )
    if not targets:
        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        raise ValueError(
            f"lora.target_modules {cfg.target_modules} match no linear layer; the model's are "
            f"named like {', '.join(linears[:4])}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for _, module in targets:
        add_adapter(module, cfg.rank, cfg.alpha, cfg.dropout)
    return [n for n, _ in targets]


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


def canonical(name: str) -> str:
    return _WRAPPERS.sub("", name)


def adapted_layers(part: nn.Module) -> dict[str, LoRALinear]:
    return {canonical(n): m for n, m in part.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def init_adapters(part: nn.Module, seed: int) -> None:
    """A as nn.Linear's default init (PEFT's too) from a generator seeded by its name; B
    zero: the adapted model starts as the base model."""

    def kaiming(t, g):
        nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)

    for name, layer in adapted_layers(part).items():
        seeded_init_(layer.lora_a, f"{name}.lora_a", seed, kaiming)
        layer.lora_b.zero_()


def merged_state(state: dict[str, torch.Tensor], parts: list[nn.Module]) -> dict:
    """A model state dict with each adapter folded into its weight and the adapters
    dropped: what the plain model computes (tensors or DTensors, as given)."""
    layers = {n: m for part in parts for n, m in adapted_layers(part).items()}
    out = {}
    for key, t in state.items():
        if is_adapter(key):
            continue
        layer = layers.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
        if layer is not None:
            a, b = state[key[: -len("weight")] + "lora_a"], state[key[: -len("weight")] + "lora_b"]
            t = t + layer.lora_scale * (b @ a).to(t.dtype)
        out[key] = t
    return out
