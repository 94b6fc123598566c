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
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.grouped_mm import grouped_mm
from titan.models.common.init import seeded_init_
from titan.models.common.moe import GroupedExperts
from titan.parallelisms.activation_checkpoint import recomputed_in_backward
from titan.runtime.names import canonical_name


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update; made by `add_adapter`, not constructed."""

    # (down, up): the factors tensor parallelism places after the weight it updates
    low_rank_factors = ("lora_a", "lora_b")
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        # a rank-r product costs r/in of the layer's to recompute: per-op AC keeps nothing
        with _recomputed():
            h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
            return out + self.lora_scale * F.linear(F.linear(h, self.lora_a), self.lora_b)


class LoRAExperts(GroupedExperts):
    """Routed experts whose stacked weights (some of w1, w2, w3) each have a low-rank update
    per expert: `lora_a_<w>` (experts, r, in) and `lora_b_<w>` (experts, out, r); made by
    `add_expert_adapters`. The update runs as two more grouped GEMMs on the same rows."""

    lora_scale: float
    lora_dropout: float
    lora_weights: tuple[str, ...]

    def product(self, t, name, offsets=None, expert=-1):
        out = super().product(t, name, offsets, expert)
        if name not in self.lora_weights:
            return out
        a, b = getattr(self, f"lora_a_{name}"), getattr(self, f"lora_b_{name}")
        with _recomputed():
            h = F.dropout(t, self.lora_dropout, self.training) if self.lora_dropout else t
            if expert >= 0:
                low = F.linear(F.linear(h, a[expert]), b[expert])
            else:
                low = grouped_mm(h, a.transpose(-2, -1), offsets)
                low = grouped_mm(low, b.transpose(-2, -1), offsets)
            return out + self.lora_scale * low


def _recomputed():
    # a compiled block traces no thread-local flag: there the AC policy's own rule applies
    return nullcontext() if torch.compiler.is_compiling() else recomputed_in_backward()


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Turn `linear` into a LoRALinear in place (on whatever device it is)."""
    linear.__class__ = LoRALinear
    linear.lora_scale, linear.lora_dropout = alpha / rank, dropout
    _add_factors(linear, "weight", "lora_a", "lora_b", rank)


def add_expert_adapters(
    experts: GroupedExperts, weights: list[str], rank: int, alpha: float, dropout: float
) -> None:
    """Turn `experts` into LoRAExperts with updates of `weights` (of w1, w2, w3) in place."""
    experts.__class__ = LoRAExperts
    experts.lora_scale, experts.lora_dropout = alpha / rank, dropout
    experts.lora_weights = tuple(weights)
    for w in weights:
        _add_factors(experts, w, f"lora_a_{w}", f"lora_b_{w}", rank)


def _add_factors(module: nn.Module, weight: str, a: str, b: str, rank: int) -> None:
    """A (..., rank, in) and B (..., out, rank) beside `module.<weight>` (..., out, in), which
    freezes (with its bias, for a linear layer)."""
    w = getattr(module, weight)
    w.requires_grad_(False)
    if weight == "weight" and getattr(module, "bias", None) is not None:
        module.bias.requires_grad_(False)
    *lead, out, inp = w.shape
    make = dict(device=w.device, dtype=w.dtype)
    module.register_parameter(a, nn.Parameter(torch.empty(*lead, rank, inp, **make)))
    module.register_parameter(b, nn.Parameter(torch.empty(*lead, out, rank, **make)))


def apply_lora(model: nn.Module, cfg) -> list[str]:
    """Adapters on what `cfg` (the lora section) targets: linear layers by name
    (layers.0.attention.wq) and routed experts' stacked weights by theirs
    (layers.1.feed_forward.experts.w1); every other parameter frozen. Returns the adapted
    weights' names (without ".weight" for linear layers); raises ValueError when nothing is
    targeted or a target is neither."""
    patterns = [re.compile(p) for p in cfg.target_modules]

    def hit(name: str) -> bool:
        return any(p.search(name) for p in patterns)

    linears, experts, odd = [], [], []
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            chosen = [w for w in ("w1", "w2", "w3") if hit(f"{name}.{w}")]
            if chosen:
                experts.append((name, m, chosen))
            elif hit(name):
                odd.append(f"{name} (routed experts: name their weights, {name}.w1 ...)")
        elif name and hit(name):
            (linears if type(m) is nn.Linear else odd).append(
                (name, m) if type(m) is nn.Linear else f"{name} ({type(m).__name__})"
            )
    if odd:
        raise ValueError(
            f"lora.target_modules {cfg.target_modules} match {', '.join(odd[:3])}: adapters go "
            "on plain linear layers and routed experts' weights; narrow the regexes (end "
            "them with $)"
        )
    if not linears and not experts:
        names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        raise ValueError(
            f"lora.target_modules {cfg.target_modules} match no linear layer; the model's are "
            f"named like {', '.join(names[:4])}"
        )
    widths = [(n, min(m.in_features, m.out_features)) for n, m in linears] + [
        (f"{n}.{w}", min(getattr(m, w).shape[-2:])) for n, m, chosen in experts for w in chosen
    ]
    name, narrowest = min(widths, key=lambda w: w[1])
    if cfg.rank > narrowest:
        raise ValueError(
            f"lora.rank {cfg.rank} is more than {name}'s smaller side ({narrowest}): an "
            f"adapter of that rank is no low-rank update; use lora.rank <= {narrowest}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for _, module in linears:
        add_adapter(module, cfg.rank, cfg.alpha, cfg.dropout)
    for _, module, chosen in experts:
        add_expert_adapters(module, chosen, cfg.rank, cfg.alpha, cfg.dropout)
    return [n for n, _ in linears] + [f"{n}.{w}" for n, _, chosen in experts for w in chosen]


def is_adapter(name: str) -> bool:
    return name.rpartition(".")[2].startswith(("lora_a", "lora_b"))


canonical = canonical_name  # wrappers the parallelisms add are not part of a name


@dataclass(frozen=True)
class Update:
    """One adapted weight: its module, its factors' attribute names, the scale."""

    module: nn.Module
    weight: str
    a: str
    b: str

    @property
    def scale(self) -> float:
        return self.module.lora_scale

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self.module, self.a), getattr(self.module, self.b)


def adapter_updates(part: nn.Module) -> dict[str, Update]:
    """Every adapted weight of `part` by its parameter name (layers.0.attention.wq.weight,
    layers.1.feed_forward.experts.w1)."""
    out = {}
    for name, m in part.named_modules():
        if isinstance(m, LoRALinear):
            out[canonical(f"{name}.weight")] = Update(m, "weight", "lora_a", "lora_b")
        elif isinstance(m, LoRAExperts):
            for w in m.lora_weights:
                out[canonical(f"{name}.{w}")] = Update(m, w, f"lora_a_{w}", f"lora_b_{w}")
    return out


@torch.no_grad()
def init_adapters(part: nn.Module, seed: int) -> None:
    """A as nn.Linear's default init (PEFT's too: uniform within 1/sqrt(in)), each from a
    generator seeded by its name; B zero: the adapted model starts as the base model."""
    for name, update in adapter_updates(part).items():
        a, b = update.factors()
        bound = 1 / math.sqrt(a.shape[-1])
        prefix = name.rpartition(".")[0]
        seeded_init_(
            a, f"{prefix}.{update.a}", seed, lambda t, g, r=bound: t.uniform_(-r, r, generator=g)
        )
        b.zero_()


def merged_state(state: dict[str, torch.Tensor], parts: list[nn.Module]) -> dict:
    """A model state dict with each adapter folded into its weight and the adapters
    dropped: what the plain model computes (tensors or DTensors, as given)."""
    updates = {n: u for part in parts for n, u in adapter_updates(part).items()}
    out = {}
    for key, t in state.items():
        if is_adapter(key):
            continue
        update = updates.get(key)
        if update is not None:
            prefix = key.rpartition(".")[0]
            a, b = state[f"{prefix}.{update.a}"], state[f"{prefix}.{update.b}"]
            t = t + update.scale * (b @ a).to(t.dtype)
        out[key] = t
    return out
