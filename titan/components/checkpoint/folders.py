"""DCP checkpoints: one folder per step, visible only once complete, exact resume.

Layout: `<dump_folder>/<folder>/step-N/` holds DCP shards, `.metadata`, and a `.complete`
marker that rank 0 writes (atomically, fsynced) only after every rank's data and the metadata
are on disk. The marker records the step, the layout, the model the save was made from
(`identity`) and every file's size and checksum (`integrity`).
Everything here refuses folders without it. Resume takes the newest folder that is complete
and whose files match what was written; torn or corrupt ones are skipped with a warning.

The state dict is nested, `{"model": {<name>: tensor}, "optimizer": ..., ...}`; DCP flattens it,
so the weights are stored under `model.<name>`. A model-only export holds just `"model"`; the
single-process readers/writers of those (used by the convert scripts) need no process group
(DCP's `no_dist=True`). Nothing here unpickles checkpoint data.

This module holds the folder rules and the model-only readers/writers; `checkpointer.py`
saves and restores a training run with them.
"""

import contextlib
import json
import logging
import re
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titan.components.checkpoint.integrity import file_problem
from titan.components.checkpoint.storage import as_path, dcp_reader, is_remote, write_whole
from titan.runtime.names import canonical_name

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
MODEL_KEY = "model"


class CheckpointError(RuntimeError):
    """A checkpoint / HF folder that cannot be read or does not fit the model."""


# ----------------------------------------------------------------------------- folders


def step_folder(root: Path, step: int) -> Path:
    """The folder of `step`'s checkpoint under `root`."""
    return root / f"step-{step}"


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-N` folder under `root`, oldest first."""
    out = []
    for p in root.glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def newer_history(root: Path, step: int, problem=None) -> list[tuple[Path, str]]:
    """(folder, what it is) of every sound `step-N` folder under `root` with N > `step`:
    another history (a run that went back with checkpoint.load_step) or an export a resume
    cannot continue from. A save cut short or damaged (what `problem(path)`, folder_problem
    by default, finds wrong) is not: the run writes that step again."""
    out = []
    for n, path in step_folders(root):
        if n <= step:
            continue
        why = (problem or folder_problem)(path)
        if why is None or why == HF_EXPORT:
            out.append((path, "an HF export" if why else "a checkpoint"))
    return out


def set_aside_newer(root: Path, resumed: Path | None, problem, rank: int) -> Path | None:
    """A folder holds one history: the sound steps after the one a run resumes from
    (`resumed`; all of them on a fresh start) belong to another (a run that went back with
    checkpoint.load_step) or are an export a resume cannot continue from. Rank 0 moves them,
    whole, into `root/history.K` (the first free K), logged and never deleted, before the
    run writes its own steps there, and returns that folder (None: nothing moved, and on
    the other ranks). Collective where there is something to move."""
    step = int(resumed.name.split("-")[1]) if resumed is not None else 0
    newer = newer_history(root, step, problem)
    if not newer:
        return None
    names = ", ".join(f"{p.name} ({what})" for p, what in newer)
    if is_remote(root):
        raise CheckpointError(
            f"{root} holds steps after the one this run starts from: {names}; titan sets "
            "another history aside only on a local disk: copy them elsewhere (or remove "
            "them), or start from the newest with checkpoint.load_step = -1"
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has chosen its step before a folder moves
    if rank != 0:
        return None
    k = 1
    while (root / f"history.{k}").exists():
        k += 1
    dest = root / f"history.{k}"
    dest.mkdir()
    for path, _ in newer:
        path.rename(dest / path.name)
    start = f"resuming from {resumed.name}" if resumed is not None else "starting afresh"
    logger.warning(
        "%s: %s; the folder's newer %s kept in %s, out of this run's history",
        root,
        start,
        names,
        dest,
    )
    return dest


def latest_complete_step(root: str | Path) -> Path | None:
    """The highest `step-N` folder under `root` that holds the `.complete` marker."""
    for _, p in reversed(step_folders(as_path(root))):
        if (p / COMPLETE_MARKER).is_file():
            return p
    return None


def check_complete(path: str | Path) -> Path:
    path = as_path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    if not (path / COMPLETE_MARKER).is_file():
        hint = ""
        steps = step_folders(path)
        if steps:
            names = ", ".join(p.name for _, p in steps[-3:])
            hint = f"; it looks like a checkpoint root holding {names} - pass one step-N folder"
        raise CheckpointError(
            f"{str(path)!r} is not a completed checkpoint: no {COMPLETE_MARKER} marker (the save "
            f"was interrupted, is still running, or this is not a step folder){hint}"
        )
    return path


def write_complete_marker(
    path: Path,
    step: int,
    model_only: bool,
    layout: dict | None = None,
    fmt: str = "dcp",
    model: dict | None = None,
    files: dict[str, list[int]] | None = None,
    trained_with: dict | None = None,
) -> None:
    """Mark `path` complete, written whole (storage.write_whole) and last. The marker
    records the step, the format ("dcp", or "hf" for an HF export), the parallel layout that
    saved it, the model it holds (`identity.ModelIdentity`'s record), what else it trained
    with (`trained_with`: optimizer, tokenizer) and each file's [crc32, size] as written."""
    marker = {
        "step": step,
        "model_only": model_only,
        "time": time.time(),
        "layout": layout,
        "format": fmt,
        "model": model,
        "files": files,
        "trained_with": trained_with,
    }
    write_whole(path / COMPLETE_MARKER, json.dumps(marker))


def _marker(path: Path) -> dict:
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def saved_model(path: Path) -> dict | None:
    """The model record of a complete folder's marker (None for saves older than it)."""
    return _marker(path).get("model")


def saved_model_only(path: Path) -> bool:
    return bool(_marker(path).get("model_only"))


def saved_files(path: Path) -> dict[str, list[int]] | None:
    """{file name: [crc32, size]} as written (None for saves older than checksums)."""
    return _marker(path).get("files")


def saved_layout(path: Path) -> dict | None:
    """The parallel layout recorded in a complete folder's marker (None if it has none)."""
    return _marker(path).get("layout")


HF_EXPORT = "an HF export (model weights only)"


def folder_problem(path: Path, verify: str = "fast") -> str | None:
    """Why a step folder cannot be loaded, or None if it is complete and its files add up:
    `verify` "off" trusts the marker, "fast" compares the sizes, "full" the checksums too."""
    if not (path / COMPLETE_MARKER).is_file():
        return "incomplete (no completion marker: the save was interrupted)"
    marker = _marker(path)
    if not marker:
        return f"unreadable completion marker {COMPLETE_MARKER}"
    if marker.get("format") == "hf":
        return HF_EXPORT
    if verify == "off":
        return None
    for name, expected in sorted((marker.get("files") or {}).items()):
        why = file_problem(path, name, expected, full=verify == "full")
        if why:
            return why
    try:
        metadata = dcp_reader(path).read_metadata()
    except Exception as e:  # noqa: BLE001  any unreadable metadata means unusable
        return f"unreadable metadata ({type(e).__name__}: {e})"
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, needed in sizes.items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size < needed:
            return f"truncated file {name} ({f.stat().st_size} of {needed} bytes)"
    return None


def resume_candidate(root: Path, load_step: int, problem=folder_problem, warn=None) -> Path | None:
    """The step folder a resume loads: `load_step`'s, else the newest usable one; None when
    there is none to resume from. `problem(path)` says why a folder is unusable; skipped
    folders are reported through `warn(message)`. Raises CheckpointError when `load_step`'s
    folder cannot be used, or when every completed folder is damaged (starting afresh would
    write over the run's history)."""
    if load_step >= 0:
        path = step_folder(root, load_step)
        why = problem(path) if path.is_dir() else "does not exist"
        if why:
            have = [p.name for _, p in step_folders(root)] if root.is_dir() else []
            raise CheckpointError(
                f"checkpoint.load_step = {load_step}: {path} {why}"
                + (f" (the folder holds {', '.join(have[-5:])})" if have else "")
                + "; set checkpoint.load_step to one of them, or -1 for the newest usable one"
            )
        return path
    path, skipped = _newest_usable(root, problem)
    if path is not None:
        for name, reason in skipped:
            if warn and reason == HF_EXPORT:
                warn(
                    f"checkpoint {name} is {HF_EXPORT}, not a training state: kept; resuming "
                    f"from {path.name}"
                )
            elif warn:
                warn(f"checkpoint {name} is unusable ({reason}); resuming from {path.name} instead")
        return path
    completed = [(n, r) for n, r in skipped if not r.startswith(("incomplete", HF_EXPORT))]
    if completed:
        details = "; ".join(f"{n}: {r}" for n, r in skipped)
        raise CheckpointError(
            f"no usable checkpoint in {root} ({details}). Fix or remove the damaged "
            "folders, or point checkpoint.folder / job.dump_folder elsewhere to start fresh"
        )
    for name, reason in skipped:
        if warn:
            warn(f"ignoring checkpoint {name}: {reason}")
    return None


def _newest_usable(root: Path, problem) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest step folder under `root` that `problem` finds nothing wrong with (None:
    none), and (name, why) of each newer one it skipped."""
    skipped = []
    for _, path in reversed(step_folders(root) if root.is_dir() else []):
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append((path.name, why))
    return None, skipped


def intact_folder(path: Path, flag: str, using: str, warn) -> Path:
    """For the tools that read one checkpoint (generate, convert_to_hf): a step folder as
    given, its files checked against their checksums; for a checkpoint root, its newest intact
    step (a final HF save too), with `warn(message)` for each newer one that is damaged. A
    folder that is neither, or a root without a completed step, is returned as it is, for the
    caller to say what it lacks. Raises CheckpointError, naming `flag`, when the folder given
    or every step is damaged."""

    def problem(folder: Path) -> str | None:
        why = folder_problem(folder, "full")
        return None if why == HF_EXPORT else why

    if (path / COMPLETE_MARKER).is_file():
        why = problem(path)
        if why:
            raise CheckpointError(
                f"{flag} {path} is damaged: {why}; pass another step folder, "
                "or the checkpoint root to use its newest intact step"
            )
        return path
    folder, skipped = _newest_usable(path, problem)
    if folder is not None:
        for name, reason in skipped:
            warn(f"{name} is unusable ({reason}); {using} {folder.name} instead")
        return folder
    if all(why.startswith("incomplete") for _, why in skipped):
        return path  # no completed save at all: for the caller to say what it lacks
    raise CheckpointError(
        f"{flag} {path} holds no intact step folder ("
        + "; ".join(f"{name}: {why}" for name, why in skipped[:3])
        + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        + "): pass an intact step folder or an HF folder"
    )


def saved_keys(path: Path) -> set[str]:
    metadata = dcp_reader(path).read_metadata()
    return {k.split(".", 1)[0] for k in metadata.state_dict_metadata}


# ----------------------------------------------------------------------------- model-only folders


def _not_single_process_note(record) -> bool:
    return "Running in single process mode" not in record.getMessage()


@contextlib.contextmanager
def _quiet_no_dist():
    """DCP warns on every no_dist call that it assumes single-process use, and its HF
    consolidation logs the same; we mean it."""
    consolidation = logging.getLogger("torch.distributed.checkpoint._consolidate_hf_safetensors")
    consolidation.addFilter(_not_single_process_note)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to.*single process.*"
            )
            yield
    finally:
        consolidation.removeFilter(_not_single_process_note)


def dcp_model_metadata(path: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{titan name: (global shape, dtype)} of the `model` entry of a DCP checkpoint folder."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = check_complete(path)
    md = dcp_reader(path).read_metadata()
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, meta in md.state_dict_metadata.items():
        fqn = planner_data.get(key)
        if fqn is not None:  # (top-level key, name): DCP keeps the nesting here
            if len(fqn) != 2 or fqn[0] != MODEL_KEY:
                continue
            name = fqn[1]
        elif key.startswith(MODEL_KEY + "."):
            name = key[len(MODEL_KEY) + 1 :]
        else:
            continue
        if not isinstance(meta, TensorStorageMetadata):
            continue  # non-tensor model extras (none in titan); nothing to convert
        out[name] = (meta.size, meta.properties.dtype)
    if not out:
        sample = ", ".join(sorted(md.state_dict_metadata)[:5])
        raise CheckpointError(
            f"{str(path)!r} holds no '{MODEL_KEY}.*' tensors (first keys: {sample}); titan "
            f"checkpoints nest the weights under '{MODEL_KEY}'"
        )
    return out


def load_dcp_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of a DCP checkpoint's `model` entry, by titan name.

    Works on full training checkpoints (the optimizer etc. are not read) and model-only
    exports, whatever sharding they were saved with; no process group needed.
    """
    meta = dcp_model_metadata(path)
    state = {
        name: torch.empty(size, dtype=dtype, device="cpu") for name, (size, dtype) in meta.items()
    }
    with _quiet_no_dist():
        dcp.load({MODEL_KEY: state}, storage_reader=dcp_reader(as_path(path)), no_dist=True)
    return {canonical_name(name): t for name, t in state.items()}


def save_dcp_model_state(
    state: dict[str, torch.Tensor],
    path: str | Path,
    overwrite: bool = False,
    model: dict | None = None,
) -> Path:
    """Write a model-only DCP checkpoint `{"model": state}` and its `.complete` marker.

    The result is what `checkpoint.initial_load_path` (and `last_save_model_only`) expect;
    `model` is the identity record to store (`ModelIdentity.record()`), when known.
    Full tensors in one process, or DTensor shards with every rank of a process group calling.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    path = Path(path)
    problem = None
    if rank0 and path.exists() and any(path.iterdir()):
        if not overwrite:
            problem = (
                f"{str(path)!r} exists and is not empty; pass overwrite=True "
                "(--overwrite) to replace it"
            )
        else:
            (path / COMPLETE_MARKER).unlink(missing_ok=True)  # incomplete while rewriting
            for old in [path / ".metadata", *path.glob("*.distcp")]:
                old.unlink(missing_ok=True)
    if distributed:  # every rank stops, or none does
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise CheckpointError(problem)
    if rank0:
        path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    from titan.components.checkpoint.integrity import (
        ChecksummingWriter,
        collect_sidecars,
        remove_sidecars,
    )

    with _quiet_no_dist():
        dcp.save(
            {MODEL_KEY: tensors},
            checkpoint_id=str(path),
            no_dist=not distributed,
            storage_writer=ChecksummingWriter(str(path)),
        )
    if rank0:  # dcp.save returns once every rank's files and the metadata are written
        write_complete_marker(
            path, step=-1, model_only=True, model=model, files=collect_sidecars(path)
        )
        remove_sidecars(path)
    return path
