"""muP as a model converter: the width multiplier m = dim / mup.base_width sets the logit
multiplier (1/m) and the attention scale on the meta model, scales the hidden matrices' init
after the family's (1/sqrt(m)), and gives the optimizer each parameter's lr factor
(titan.components.mup.rules)."""

import logging

import torch

from titan.components.converters import Converter
from titan.components.mup import rules
from titan.components.optim.registry import clean_name
from titan.models.common.attention import Attention

logger = logging.getLogger(__name__)


class MupConverter(Converter):
    """`muon`: the [muon] section where the optimizer is Muon (its adjust_lr and adamw_params
    decide the hidden matrices' factor)."""

    def __init__(self, base_width: int, base_head_dim: int = 0, optimizer="AdamW", muon=None):
        self.base_width, self.base_head_dim = base_width, base_head_dim
        self.optimizer, self.muon = optimizer, muon
        self.m: float | None = None
        self.q_scale = 1.0

    def convert(self, model) -> None:
        args = model.args
        self.m = args.dim / self.base_width
        base_hd = self.base_head_dim or args.with_updates(dim=self.base_width).head_dim
        self.q_scale = rules.q_scale(args.head_dim, base_hd)
        model.output_scale = 1.0 / self.m
        for module in model.modules():
            if isinstance(module, Attention):
                module.q_scale = self.q_scale

    def _width(self) -> float:
        if self.m is None:
            raise RuntimeError("the muP converter is asked before it converted the model")
        return self.m

    @torch.no_grad()
    def init_weights(self, part, seed: int) -> None:
        """Once, after the family's init: the hidden matrices' std divided by sqrt(m) (an
        elementwise scale, so a shard scales alike and the layout does not matter)."""
        m = self._width()
        for name, p in part.named_parameters():
            scale = rules.init_scale(clean_name(name), p.ndim, m)
            if scale != 1.0:
                p.mul_(scale)

    @torch.no_grad()
    def fold(self, state: dict, parts) -> dict:
        """The logit multiplier into the output matrix, the attention scale into each query
        (its norm's weight, or its projection where it has no norm): RoPE is linear, so a
        query scaled before it is the query scaled after it."""
        if self.m is None:
            return state
        out = dict(state)
        if "output.weight" in out:
            if any("output.weight" in pair for part in parts for pair in part.tied_parameters()):
                raise ValueError(
                    "muP's logit multiplier cannot be folded into an output matrix the "
                    "embedding shares: train muP untied to export it"
                )
            out["output.weight"] = out["output.weight"] * (1.0 / self.m)
        if self.q_scale == 1.0:
            return out
        for part in parts:
            for name, module in part.named_modules():
                if isinstance(module, Attention):
                    _fold_q_scale(out, clean_name(name), module, self.q_scale)
        return out

    def parametrization(self) -> dict:
        return {"mup": {"base_width": self.base_width, "base_head_dim": self.base_head_dim}}

    def lr_scale(self, name: str, param) -> float:
        return rules.lr_scale(name, param.ndim, self._width(), self.optimizer, self.muon)

    def describe(self, parts, pipelined: bool) -> None:
        m = self._width()
        hidden = next(
            (
                clean_name(n)
                for part in parts
                for n, p in part.named_parameters()
                if rules.is_hidden(clean_name(n), p.ndim)
            ),
            None,
        )
        lr = rules.lr_scale(hidden, 2, m, self.optimizer, self.muon) if hidden else 1.0
        logger.info(
            "muP: width multiplier %.4g (base width %d): hidden init x %.4g, hidden lr x %.4g "
            "(%s), logits x %.4g, attention scale x %.4g",
            m,
            self.base_width,
            m**-0.5,
            lr,
            self.optimizer,
            1.0 / m,
            self.q_scale,
        )


def _fold_q_scale(state: dict, prefix: str, attention: Attention, scale: float) -> None:
    norm = attention.q_norm
    if norm is not None:
        if type(norm) is not torch.nn.RMSNorm or norm.weight is None:
            raise ValueError(
                f"{prefix}: muP's attention scale cannot be folded into a "
                f"{type(norm).__name__}: export needs a plain RMSNorm on the queries"
            )
        key = f"{prefix}.q_norm.weight"
        if key in state:
            state[key] = state[key] * scale
        return
    if attention.gated:
        raise ValueError(f"{prefix}: the query rows of a gated projection are not folded")
    for key in (f"{prefix}.wq.weight", f"{prefix}.wq.bias"):
        if key in state:
            state[key] = state[key] * scale


def build(job) -> MupConverter:
    return MupConverter(
        job.mup.base_width,
        job.mup.base_head_dim,
        job.optimizer.name,
        job.extensions.get("muon"),
    )
