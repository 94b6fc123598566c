"""torch.compile, per transformer block (fast to compile, reused across identical blocks)."""

from torch import nn


def compile_blocks(layers: nn.ModuleDict, backend: str) -> None:
    # Module.compile works in place, so parameter names (and checkpoints) stay unchanged
    for block in layers.values():
        block.compile(backend=backend, fullgraph=True)


def compile_whole(model: nn.Module, backend: str) -> None:
    model.compile(backend=backend)
