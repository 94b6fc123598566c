"""What happens to an MoE's routing after each optimizer step (a post-optimizer hook of the
model contract): the step's token choices per expert, summed over every microbatch and rank,
move DeepSeek-V3's routing bias, and give the load metrics.

Every rank calls one all-reduce of a (layers, experts) table per step: a pipeline stage fills
the rows of its own layers, and the sum reaches every stage. What a layout adds to the sum is a
whole multiple of a layer's counts (tensor-parallel ranks without sequence parallelism each see
every token; activation checkpointing counts a recomputed layer again), and both the sign rule
and max/mean are unchanged by it, so every layout moves the bias and reports the imbalance as
one process does.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan.models.common.moe import MoE, update_expert_bias_


def _moe_layers(parts: list[nn.Module]) -> dict[int, MoE]:
    """Layer index -> its MoE, over this rank's model parts (pipeline stages keep the whole
    model's names: layers.<i>.*)."""
    out = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                out[int(name.split(".")[1])] = module
    return out


def moe_balance_hook(parts: list[nn.Module], job) -> Callable[[bool], dict] | None:
    """The hook of a model with MoE layers (None for a dense one). Each call returns the step's
    metrics: `expert_load_imbalance` (the largest over layers of max / mean tokens per expert)
    and `expert_load/layer_<i>` (each expert's share of the layer's tokens, for TensorBoard);
    with a capacity factor, `moe_dropped_pct` (the share of all token choices dropped) and
    `moe_dropped_pct/layers` (each MoE layer's share, a list); all as tensors on the device:
    nothing waits for the device until a step is logged (the trainer reads them then, all in
    one copy)."""
    args = parts[0].args
    if args.moe_args() is None:
        return None
    # each layer's choices per expert, and in the last column its dropped choices
    table_shape = (args.block_count(), args.moe_args().n_experts + 1)
    dropping = args.moe_args().capacity_factor is not None
    local = _moe_layers(parts)
    moe_rows = [i for i in range(args.block_count()) if args.is_moe_layer(i)]

    def after_step(taken: bool) -> dict:
        if not taken:  # a skipped step's routing moves nothing
            for moe in local.values():
                moe.expert_load.zero_()
                moe.dropped.zero_()
            return {}
        some = next(iter(local.values()), None)
        device = some.expert_load.device if some is not None else _device(parts)
        counts = torch.zeros(table_shape, device=device)
        for i, moe in local.items():
            counts[i, :-1] = moe.expert_load
            counts[i, -1] = moe.dropped
            moe.expert_load.zero_()
            moe.dropped.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        counts, dropped = counts[:, :-1], counts[:, -1]
        for i, moe in local.items():
            rate = moe.args.bias_update_rate
            if rate:
                update_expert_bias_(moe.router.expert_bias, counts[i], rate)
        rows = counts[moe_rows]
        choices = rows.sum(dim=1)
        share = rows / choices[:, None].clamp(min=1)
        imbalance = (rows.max(dim=1).values / rows.mean(dim=1).clamp(min=1e-9)).max()
        out = {
            "expert_load_imbalance": imbalance,
            **{f"expert_load/layer_{i}": share[n] for n, i in enumerate(moe_rows)},
        }
        if dropping:
            drops = dropped[moe_rows]
            out["moe_dropped_pct"] = 100 * drops.sum() / choices.sum().clamp(min=1)
            out["moe_dropped_pct/layers"] = 100 * drops / choices.clamp(min=1)
        return out

    return after_step


def _device(parts: list[nn.Module]) -> torch.device:
    return next(p.device for part in parts for p in part.parameters())
