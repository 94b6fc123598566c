"""Whether a checkpoint's disk holds one more save: asked by the launcher before a run and by
the checkpointer before each save, so a full disk stops a save before it writes a torn folder
(and, on the next start, before torchrun starts workers that would fail the same way)."""

import shutil
from pathlib import Path

# DCP's per-tensor framing and the small states (data position, RNG) on top of the tensors
OVERHEAD_FACTOR, OVERHEAD_BYTES = 1.02, 1 << 20


def save_bytes(n_params: int, optimizer_state_dtype: str) -> int:
    """The size of one training save: float32 weights, and AdamW's two moments."""
    moment = 2 if optimizer_state_dtype == "bfloat16" else 4
    return int(n_params * (4 + 2 * moment) * OVERHEAD_FACTOR) + OVERHEAD_BYTES


def free_bytes(folder: Path) -> int:
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def space_problem(folder: Path, need: int) -> str | None:
    """Why `folder`'s disk cannot take `need` more bytes (None if it can)."""
    free = free_bytes(folder)
    if free >= need:
        return None
    return (f"checkpoint.folder {folder}: a save needs {need / 2**30:.2f} GiB and its disk has "
            f"{free / 2**30:.2f} GiB free; free space there, lower checkpoint.keep_latest_k, or "
            "point job.dump_folder at a larger disk")
