"""Tensor-parallel helpers that know no model: the plans themselves live with each family
(e.g. titan/models/common/parallelize.py) and go through torch's `parallelize_module`."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle


def replicate_modules(modules: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Keep `modules` whole on every tp rank, as replicated DTensors.

    Without sequence parallelism the norms are not split; as replicated DTensors they still
    mix with the sharded parameters in one foreach optimizer step and in the global
    grad-norm reduction (plain tensors beside DTensors make foreach AdamW fail).
    """
    for module in modules:
        distribute_module(module, tp_mesh, input_fn=_replicate_inputs, output_fn=_local_output)


def _replicate_inputs(module, inputs, mesh):
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_output(module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def shard_grads_like_params(params: list[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's sharding, as FSDP does for its own: TP's
    embedding backward leaves the Shard(0) weight a whole Replicate() gradient (vocab x dim
    on every rank, 1.7 GiB more for Llama 3 8B under TP 8) until the optimizer step, and a
    tied pipeline copy's sharded gradient could not be summed with it."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


class LocalTokens(ParallelStyle):
    """A module that runs on each tp rank's own tokens with whole weights (an MoE's router and
    routed experts, whose token sort and grouped GEMM DTensor cannot shard).

    Its parameters become replicated DTensors, so that they step, clip and shard with FSDP
    like every other parameter; within its forward they are plain local tensors. With
    `sum_grads` (sequence parallelism: each rank saw other tokens) their gradients are partial
    sums that the parameter's placement completes over the tp ranks; without it (every rank
    saw every token) each rank's gradient is already the whole one."""

    def __init__(self, sum_grads: bool):
        super().__init__()
        self.grad_placements = (Partial(),) if sum_grads else (Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)  # every parameter replicated
        local_in_forward(module, grad_placements=self.grad_placements)
        return module


def local_in_forward(
    module: nn.Module, names: tuple[str, ...] | None = None, grad_placements=None
) -> None:
    """Within `module`'s forward, its DTensor parameters (those of it and its submodules, or
    with `names` those of its own) are their local tensors in the parameter's slot, the way
    FSDP swaps in its unsharded parameters; `grad_placements` as DTensor.to_local takes it.
    The parameter is read from its slot at each call: FSDP swaps its own in and out too."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def held(mod):
        if names is not None:
            return [(mod, n, mod._parameters[n]) for n in names]
        return [(sub, n, p) for sub in mod.modules() for n, p in list(sub._parameters.items())]

    def to_local(mod, args):
        for sub, name, p in held(mod):
            if isinstance(p, DTensor):
                swapped.append((sub, name, p))
                sub._parameters[name] = p.to_local(grad_placements=grad_placements)

    def restore(mod, args, output):
        while swapped:
            sub, name, p = swapped.pop()
            sub._parameters[name] = p

    # outside torch.compile's graphs: they rewrite the module's parameter slots
    module.register_forward_pre_hook(torch.compiler.disable(to_local))
    module.register_forward_hook(torch.compiler.disable(restore))


class SumInputGrads(ParallelStyle):
    """A module whose first input every tp rank's share of the heads reads (MLA's rotated key,
    one for all heads): forward unchanged, backward sums that input's gradient over the tp
    ranks, so that what produced it sees the whole gradient, as without TP."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def summed_in_backward(mod, args):
            # a replicated DTensor whose local gradient is declared partial: its backward
            # all-reduces, its forward moves nothing
            x = DTensor.from_local(args[0], device_mesh, [Replicate()], run_check=False)
            return (x.to_local(grad_placements=[Partial()]), *args[1:])

        module.register_forward_pre_hook(summed_in_backward)
        return module


def place_low_rank_factors(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The factors of a low-rank update W + B A (a module's `low_rank_factors`, (A, B)) placed
    after the tensor-parallel weight W on the meta device: A takes W's input-dim split, B its
    output-dim split. Column-parallel W (rows split): A whole, B's rows split; row-parallel W
    (columns split): A's columns split, B whole. The update then needs no collective of its
    own: it is split (or partial) exactly as x W^T is. The styles place only W (and the
    column style splits every parameter's rows, which cuts A through its rank). A replicated
    W keeps both whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in model.modules():
        names = getattr(module, "low_rank_factors", None)
        weight = getattr(module, "weight", None)
        if names is None or not isinstance(weight, DTensor):
            continue
        if weight.placements == (Shard(0),):
            placements = ([Replicate()], [Shard(0)])
        elif weight.placements == (Shard(1),):
            placements = ([Shard(1)], [Replicate()])
        elif weight.placements == (Replicate(),):  # a layer each rank runs whole
            placements = ([Replicate()], [Replicate()])
        else:
            raise ValueError(f"no low-rank factor placement for a weight {weight.placements}")
        for name, place in zip(names, placements, strict=True):
            p = getattr(module, name)
            if not p.is_meta:
                raise ValueError("low-rank factors are placed on the meta device, before init")
            full = torch.empty(p.shape, dtype=p.dtype, device="meta")
            module.register_parameter(
                name,
                nn.Parameter(distribute_tensor(full, tp_mesh, place), p.requires_grad),
            )
