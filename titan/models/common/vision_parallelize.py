"""A vision tower beside a tensor-parallel decoder: the tower runs whole on every tp rank
(its fused qkv and merged widths are not split; every rank holds the same images), its
parameters replicated DTensors so that they clip, step and shard with FSDP like the rest;
under sequence parallelism the image tokens are placed into whole sequences, gathered from
and scattered back to each rank's part (one gather per placement: the embedding, and each
DeepStack layer)."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

from titan.parallelisms.tensor_parallel import LocalTokens


def tower_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if getattr(model, "visual", None) is None:
        return
    # every rank computes the same tower from the same images: whole gradients on each.
    # Swapped to local tensors module by module: FSDP gathers a block's weights at the
    # block's entry, after a hook on the tower would have run
    for module in model.visual.modules():
        if next(module.parameters(recurse=False), None) is not None:
            parallelize_module(module, tp_mesh, LocalTokens(sum_grads=False))
    if sequence_parallel:
        whole = PrepareModuleInputOutput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_input=True,
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
        )
        parallelize_module(model.image_tokens, tp_mesh, whole)
