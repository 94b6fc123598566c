"""torch.compile, per transformer block (fast to compile, reused across identical blocks)."""

import torch
from torch import nn


def _forward_side_effects_once() -> None:
    # a block's forward records values on the host (an MoE's balancing loss for logging) that
    # eager activation checkpointing must not record again when it recomputes the forward
    # (titan.models.common.aux_loss skips them there); a compiled checkpointed block would
    # break its graph on them instead, unless told that they are not replayed in backward
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_blocks(
    layers: nn.ModuleDict, backend: str, fullgraph: bool = True, dynamic: bool | None = None
) -> None:
    """`fullgraph=False` for blocks with data-dependent steps (an MoE's token counts become
    split sizes on the host under expert parallelism, or in CUDA float32): they compile in
    pieces around those. `dynamic=True` for blocks whose lengths change from step to step (a
    vision tower's patches): one graph for every length."""
    _forward_side_effects_once()
    # Module.compile works in place, so parameter names (and checkpoints) stay unchanged
    for block in layers.values():
        block.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic)


def compile_whole(model: nn.Module, backend: str) -> None:
    _forward_side_effects_once()
    model.compile(backend=backend)
