"""Layout-independent weight initialization.

Every parameter is drawn from its own CPU generator seeded by (seed, canonical name), so
its values do not depend on how the model is split, sharded or wrapped: a 1-rank run and
an 8-way FSDP x TP x PP run start from the same weights without a seed checkpoint.
"""

import hashlib
from collections.abc import Callable

import torch


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def seeded_init_(
    param: torch.Tensor, name: str, seed: int, fill: Callable[[torch.Tensor, torch.Generator], None]
) -> None:
    """Fill `param` (plain or DTensor) with fill(full_tensor, generator) computed on CPU."""
    # here, not at the top: model code imports this, and the launcher's config check imports
    # model code; DTensor's import costs it most of a second
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    full = torch.empty(param.shape, dtype=torch.float32, device="cpu")
    fill(full, gen)
    if isinstance(param, DTensor):
        # src_data_rank=None: each rank keeps its own slice of the identical full tensor, no comms
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def seeded_init_all(module, inits: dict, seed: int, prefix: str = "") -> None:
    """Fill every parameter `inits` names (its name within `module` -> its fill) with
    seeded_init_, seeded by its name, after `prefix.` when one is given (a block's place in
    the model)."""
    for name, fill in inits.items():
        path, _, attr = name.rpartition(".")
        seed_name = f"{prefix}.{name}" if prefix else name
        seeded_init_(getattr(module.get_submodule(path), attr), seed_name, seed, fill)


def normal(std: float, truncate: bool = True):
    if truncate:
        return lambda t, g: torch.nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=g)
    return lambda t, g: torch.nn.init.normal_(t, 0.0, std, generator=g)


def ones(t: torch.Tensor, g: torch.Generator) -> None:
    t.fill_(1.0)


def zeros(t: torch.Tensor, g: torch.Generator) -> None:
    t.zero_()
