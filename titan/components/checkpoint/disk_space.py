"""Whether a checkpoint's disk holds one more save: asked by the launcher before a run and by
the checkpointer before each save, so a full disk stops a save before it writes a torn folder
(and, on the next start, before torchrun starts workers that would fail the same way)."""

import shutil
from math import prod
from pathlib import Path

from titan.components.optim.registry import save_state_bytes

# DCP's per-tensor framing and the small states (data position, RNG) on top of the tensors
OVERHEAD_FACTOR, OVERHEAD_BYTES = 1.02, 1 << 20


def save_bytes(
    named_shapes: list[tuple[str, tuple[int, ...]]], optimizer_cfg, sections: dict
) -> int:
    """The size of one training save of the parameters (name, shape): float32 weights, and the
    optimizer's state as its registry entry counts it."""
    from titan.config import extensions

    # the float32 weights, and the copies of them a component keeps (an average)
    copies = 1 + extensions.weight_copies(sections)
    weights = 4 * copies * sum(prod(shape) for _, shape in named_shapes)
    state = save_state_bytes(named_shapes, optimizer_cfg, sections)
    return int((weights + state) * OVERHEAD_FACTOR) + OVERHEAD_BYTES


# more than any optimizer titan knows keeps per weight: Adam's two moments, Muon's momentum
# buffer, even AMSGrad's three float32 states (12 bytes) beside the float32 weight
GENEROUS_BYTES_PER_PARAM = 16


def generous_save_bytes(n_params: int) -> int:
    """A save's size bound that needs no model: a disk with this much free takes a save."""
    return int(n_params * GENEROUS_BYTES_PER_PARAM * OVERHEAD_FACTOR) + OVERHEAD_BYTES


def model_save_bytes(model, optimizer_cfg, sections: dict, trained_only: bool = False) -> int:
    """save_bytes of a (meta) model's parameters (`trained_only`: of those that train, what a
    save holds when the rest is a frozen base, as under LoRA)."""
    named = [
        (n, tuple(p.shape))
        for n, p in model.named_parameters()
        if p.requires_grad or not trained_only
    ]
    return save_bytes(named, optimizer_cfg, sections)


def free_bytes(folder: Path) -> int | None:
    """The free bytes of `folder`'s disk; None on an object store (no such figure: a bucket
    has no size, a quota is the provider's)."""
    from titan.components.checkpoint.storage import is_remote

    if is_remote(folder):
        return None
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def space_problem(folder: Path, need: int) -> str | None:
    """Why `folder`'s disk cannot take `need` more bytes (None if it can, or cannot know)."""
    free = free_bytes(folder)
    if free is None:
        return None
    if free >= need:
        return None
    return (
        f"checkpoint.folder {folder}: a save needs {need / 2**30:.2f} GiB and its disk has "
        f"{free / 2**30:.2f} GiB free; free space there, lower checkpoint.keep_latest_k, or "
        "point job.dump_folder at a larger disk"
    )
