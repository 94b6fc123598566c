"""torch.compile, per transformer block (fast to compile, reused across identical blocks)."""

from torch import nn


def compile_blocks(layers: nn.ModuleDict, backend: str, fullgraph: bool = True) -> None:
    """`fullgraph=False` for blocks with data-dependent steps (an MoE's token counts become
    split sizes on the host): they compile in pieces around those."""
    # Module.compile works in place, so parameter names (and checkpoints) stay unchanged
    for block in layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)


def compile_whole(model: nn.Module, backend: str) -> None:
    model.compile(backend=backend)
