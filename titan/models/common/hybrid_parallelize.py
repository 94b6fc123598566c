"""The hybrid decoder's tensor-parallel plan (Qwen3-Next, Qwen3.5): gated attention as the
common plan splits attention
(each head's query and gate rows together); Gated DeltaNet split by key-head groups (a rank
holds whole groups: their projection rows, decay parameters and convolution channels); the
gated shared expert as a dense FFN, its gate whole on every rank."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from titan.models.common.hybrid_decoder import GatedSharedExpert, LinearAttention
from titan.models.common.parallelize import (
    attention_plan,
    moe_plan,
    swiglu_ffn_plan,
)
from titan.parallelisms.tensor_parallel import LocalTokens, local_in_forward


class GroupsOfThisRank(PrepareModuleInput):
    """The mixer's input gathered as PrepareModuleInput does; its per-value-head decay
    parameters sharded with the heads (Shard(0)); its convolution whole on every rank, each
    convolving the channels of its own groups (the queries', keys' and values' rows of them,
    which are not one range), the weight's gradient summed over the ranks."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, mesh)
        for name in ("dt_bias", "A_log"):
            p = getattr(module, name)
            setattr(module, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
        local_in_forward(module, names=("dt_bias", "A_log"))
        module.conv = nn.Parameter(distribute_tensor(module.conv.data, mesh, [Replicate()]))
        rows = module.group_channels(module.k_heads, mesh.get_local_rank(), mesh.size())
        held = []

        def own_rows(mod, args):
            full = mod._parameters["conv"]
            held.append(full)
            local = full.to_local(grad_placements=[Partial()])
            mod._parameters["conv"] = local.index_select(0, rows.to(local.device))

        def restore(mod, args, output):
            mod._parameters["conv"] = held.pop()

        module.register_forward_pre_hook(torch.compiler.disable(own_rows))
        module.register_forward_hook(torch.compiler.disable(restore))
        return module


def linear_attention_plan(between) -> dict:
    return {
        "attention": GroupsOfThisRank(
            input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.in_qkvz": ColwiseParallel(),
        "attention.in_ba": ColwiseParallel(),
        # each rank normalizes its own heads: the weight whole, its gradient summed
        "attention.norm": LocalTokens(sum_grads=True),
        "attention.out": RowwiseParallel(output_layouts=between),
    }


def mixer_plan(between, mixer: nn.Module) -> dict:
    if isinstance(mixer, LinearAttention):
        return linear_attention_plan(between)
    return attention_plan(between, mixer)


class _SharedGate(ParallelStyle):
    """The shared expert's gate: whole on every rank, over every token (the shared expert's
    input is gathered). Its output scales this rank's hidden columns only, so the gradient
    each rank sends back (to its weight and to its input) is this rank's part of a sum over
    the ranks: Partial."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        LocalTokens(sum_grads=True)._apply(module, mesh)

        def local_input(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.to_local(grad_placements=[Partial()])
            return (x, *args[1:])

        module.register_forward_pre_hook(local_input)
        return module


def part_plan(model: nn.Module, between) -> dict:
    plan = {}
    for name, block in model.layers.items():
        shared = getattr(block.feed_forward, "shared_experts", None)
        if isinstance(shared, GatedSharedExpert):
            plan[f"layers.{name}.feed_forward.shared_experts.gate"] = _SharedGate()
    return plan


__all__ = ["mixer_plan", "moe_plan", "part_plan", "swiglu_ffn_plan"]
