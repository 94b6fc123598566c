"""Dense-to-MoE upcycling of the weights (titan.tools.upcycle): every MoE layer's experts
start as the dense model's FFN in that place, so that the MoE model computes what the dense
one did until training tells the experts apart.

With granularity G (fine-grained upcycling: He et al. 2024, "Upcycling Large Language Models
into Mixture of Experts", virtual-group initialization) each of the n_experts / G copies of
the FFN is split along its hidden width into G experts of width hidden / G, and a SwiGLU FFN
is exactly the sum of its G slices (silu(x W1_g) * (x W3_g) W2_g, summed over g). The G
experts of one copy share one router row, so they get one score: top_k = G x k' takes whole
copies (the k' best), each of its slices weighted p_c / (G x sum of the chosen p), and the
down projections are scaled by G, so that each chosen copy adds p_c / (sum of the chosen p)
x FFN(x): the FFN, whatever copies are chosen. Exact up to rounding while no two copies'
scores tie at the k'-th place (their G slices could then be taken apart), and while every
token keeps its choices (dropless, the default)."""

import torch

from titan.models.common.feed_forward import FeedForward
from titan.models.common.moe import MoE

ROUTER_STD = 0.02  # the routers' own initialization (MoE.param_inits)


class UpcycleError(ValueError):
    """Weights that cannot be upcycled as asked: one line naming the problem and the fix."""


def upcycled_state(
    dense_state: dict[str, torch.Tensor],
    dense_model: torch.nn.Module,
    moe_model: torch.nn.Module,
    granularity: int = 1,
    noise: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The MoE model's state dict (titan names) from the dense one's: every tensor as it is but
    each FFN the MoE model replaces, whose experts copy it (split G ways and scaled as the
    module docstring says); each router a seeded normal (std 0.02), one row per copy.
    `noise` > 0 multiplies every expert weight by (1 + noise x a seeded standard normal),
    drawn for each expert apart: the experts then differ from the start (and the first
    forward from the dense model's). `dense_model` and `moe_model` may be meta models."""
    generator = torch.Generator().manual_seed(seed)
    moe_paths = [p for p, m in moe_model.named_modules() if isinstance(m, MoE)]
    out = {
        n: t for n, t in dense_state.items() if not any(n.startswith(f"{p}.") for p in moe_paths)
    }
    for path in moe_paths:
        moe, dense = moe_model.get_submodule(path), dense_model.get_submodule(path)
        if not isinstance(dense, FeedForward):
            raise UpcycleError(
                f"{path} of the dense model is a {type(dense).__name__}, not a SwiGLU FFN: "
                "upcycle a dense checkpoint of the family"
            )
        if (
            moe.shared_experts is not None
            or moe.router.gate.bias is not None
            or moe.router.expert_bias is not None
        ):
            # a shared expert or a routing bias is not a copy of anything
            raise UpcycleError(f"{path}: the family's MoE form has parts no dense FFN gives")
        w1, w2, w3 = (dense_state[f"{path}.{n}.weight"] for n in ("w1", "w2", "w3"))
        experts, width = moe.experts.w1.shape[:2]
        hidden = w1.shape[0]
        if hidden != width * granularity:
            raise UpcycleError(
                f"the FFN width {hidden} does not split into granularity {granularity} "
                f"slices: choose a granularity that divides {hidden}"
            )
        copies = experts // granularity
        # expert c x G + g is slice g of copy c
        up = w1.reshape(granularity, width, -1)
        gate = w3.reshape(granularity, width, -1)
        down = w2.reshape(w2.shape[0], granularity, width).transpose(0, 1) * granularity
        for name, sliced in (("w1", up), ("w3", gate), ("w2", down)):
            stacked = sliced.repeat(copies, 1, 1)
            if noise:
                stacked = stacked * (1 + noise * _normal(stacked, generator))
            out[f"{path}.experts.{name}"] = stacked.contiguous()
        rows = _normal(w1.new_empty(copies, w1.shape[1]), generator) * ROUTER_STD
        out[f"{path}.router.gate.weight"] = rows.repeat_interleave(granularity, dim=0)
    return out


def _normal(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator).to(like.dtype)
