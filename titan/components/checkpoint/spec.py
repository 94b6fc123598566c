"""Checkpointing's [checkpoint] section and its checks: of the config, and once the run is
planned (the family's HF adapter, the device, writable folders); torch-free (the checkpointer
is checkpointer.py)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save DCP checkpoints and resume from the newest complete one")
    folder: str = opt("checkpoint", "Checkpoint folder inside the dump folder (step-N subfolders)")
    interval: int = opt(500, "Save every N steps (and after the last step)")
    keep_latest_k: int = opt(
        10, "Keep the newest k complete checkpoints, purge older ones; 0 = all"
    )
    write_threads: int = opt(
        2,
        "Files each rank writes at once in a save (DCP's thread_count): serializing and "
        "checksumming overlap the writes the kernel blocks in (1: one file, DCP's default)",
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled", "Copy during the next step, write in a background process; pinned needs CUDA"
    )
    enable_first_step_checkpoint: bool = opt(False, "Also save right after step 1")
    load_step: int = opt(-1, "Resume from this step's checkpoint instead of the newest (-1)")
    allow_rope_change: bool = opt(
        False,
        "A long-context phase: a resume (or initial load) may change the model's RoPE "
        "settings (rope_*: scaling factor, original length, theta) and seq_len; every other "
        "architecture field must still match",
    )
    verify: Literal["full", "fast", "off"] = opt(
        "full",
        "Before a resume: full = every file against its checksum (the ranks share the "
        "reading), fast = file sizes only, off = trust the completion marker",
    )
    initial_load_path: str | None = opt(
        None,
        "Start from this checkpoint (a step folder) or, with initial_load_in_hf, an HF "
        "safetensors folder; ignored when the checkpoint folder holds one to resume from",
    )
    initial_load_model_only: bool = opt(True, "From initial_load_path load only the model weights")
    initial_load_in_hf: bool = opt(False, "initial_load_path is an HF folder (safetensors)")
    exclude_from_loading: list[str] = opt(
        [], "State parts not restored on resume: optimizer, lr_scheduler, dataloader, train_state"
    )
    export_ema: bool = opt(
        False, "The final export (last_save_model_only / last_save_in_hf) holds the [ema] average"
    )
    last_save_model_only: bool = opt(
        False, "The final save holds only the model (in export_dtype), for export or eval"
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "Dtype of a model-only or HF final save"
    )
    last_save_in_hf: bool = opt(
        False,
        "The final save is an HF folder (sharded safetensors, config.json, tokenizer) "
        "in export_dtype, written by every rank from its shards",
    )
    hf_max_shard_size: str = opt("5GB", "Size limit of each safetensors file of an HF save")
    create_seed_checkpoint: bool = opt(
        False, "Initialize the model, save it as step-0 and exit (not needed for same-seed runs)"
    )


PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


def check(job) -> None:
    from titan.config.manager import require_all

    ck = job.checkpoint
    require_all(
        job,
        (
            (ck.interval >= 1, "checkpoint.interval", "must be >= 1"),
            (ck.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0 (0 = all)"),
            (ck.write_threads >= 1, "checkpoint.write_threads", "must be >= 1"),
            (ck.load_step >= -1, "checkpoint.load_step", "must be -1 (newest) or >= 0"),
            (
                set(ck.exclude_from_loading) <= set(PARTS),
                "checkpoint.exclude_from_loading",
                "may list only " + ", ".join(PARTS),
            ),
            (
                not ck.initial_load_in_hf or bool(ck.initial_load_path),
                "checkpoint.initial_load_in_hf",
                "needs checkpoint.initial_load_path (an HF folder)",
            ),
        ),
    )


def check_plan(job, plan) -> None:
    from titan.config.manager import require
    from titan.runtime.paths import resolve

    ck, m = job.checkpoint, job.model
    require(
        job,
        not ck.create_seed_checkpoint or ck.enable,
        "checkpoint.create_seed_checkpoint",
        "needs checkpoint.enable (the seed is written to the checkpoint folder)",
    )
    require(
        job,
        not ck.last_save_in_hf or ck.enable,
        "checkpoint.last_save_in_hf",
        "needs checkpoint.enable (the HF folder is the final save, step-N in the "
        "checkpoint folder)",
    )
    for key in ("last_save_in_hf", "initial_load_in_hf"):
        require(
            job,
            not getattr(ck, key) or plan.spec.state_dict_adapter is not None,
            f"checkpoint.{key}",
            f"model {m.name} registers no HF state-dict adapter",
        )
    require(
        job,
        not ck.initial_load_path or resolve(ck.initial_load_path).is_dir(),
        "checkpoint.initial_load_path",
        "no such folder",
    )
    if ck.async_mode == "async_with_pinned_mem":
        require(
            job,
            plan.device == "cuda",
            "checkpoint.async_mode",
            "pinned staging memory needs CUDA; use async on CPU",
        )
    check_writable(job)


def check_writable(job) -> None:
    """Dump and checkpoint folders must be writable before anything starts (whether their
    disk holds one more save is the launcher's `checkpoint_check`)."""
    from pathlib import Path

    from titan.components.checkpoint.storage import is_remote, store_problem
    from titan.config import ConfigError

    ck = job.checkpoint
    if is_remote(job.job.dump_folder):
        raise ConfigError(
            f"job.dump_folder = {job.job.dump_folder!r}: a URL dump folder is written through "
            "a local mirror that the launcher uploads; start the run with run_train.sh (or "
            "python -m titan.launcher), or give a local dump folder"
        )
    dump = Path(job.job.dump_folder)
    targets = [("job.dump_folder", dump)]
    if ck.enable and is_remote(ck.folder):
        if why := store_problem(ck.folder):
            raise ConfigError(f"checkpoint.folder = {ck.folder!r}: {why}")
    elif ck.enable:
        targets.append(("checkpoint.folder", dump / ck.folder))
    for key, path in targets:
        why = _probe_write(_existing_ancestor(path))
        if why:
            raise ConfigError(f"{key}: cannot write {path}: {why}; choose a writable location")


def _existing_ancestor(path):
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _probe_write(folder) -> str | None:
    """Why a file cannot be created in `folder` (None if it can). Leaves nothing behind.

    A real write, not os.access: root ignores permission bits but not read-only mounts or
    immutable folders.
    """
    import os
    import tempfile

    if not folder.is_dir():
        return f"{folder} exists but is not a folder"
    try:
        fd, name = tempfile.mkstemp(prefix=".titan-write-check-", dir=folder)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        return f"{folder} is not writable ({e.strerror})"
    return None


register(
    Entry(
        "checkpoint", section="checkpoint", options=Checkpoint, check=check, plan_check=check_plan
    )
)
