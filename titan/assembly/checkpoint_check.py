"""What the checkpoint folders hold and have room for: a plan check of a run about to start
(the [checkpoint] folders' entry, titan.config.core_checks), made once per launch: by the
launcher, or by rank 0 of a run started without it.

A resume of another model, a `load_step` that names no checkpoint, a folder of damaged saves
only, or a disk too small for one more save would each stop every worker after torchrun
started them; here they stop the launch with one line, before anything is written. The
workers' `Checkpointer` reads the checksums when it loads: this compares sizes only, so that a
large checkpoint is read once, not once here and once there.
"""

from pathlib import Path

from titan.components.checkpoint.disk_space import (
    free_bytes,
    generous_save_bytes,
    space_problem,
)
from titan.config import ConfigError, JobConfig
from titan.runtime.paths import resolve


def check_checkpoints(job: JobConfig, plan) -> None:
    """ConfigError for a checkpoint the run would refuse, or a disk it would fill."""
    from titan.components.checkpoint.storage import checkpoint_root

    ck = job.checkpoint
    root = checkpoint_root(job.job.dump_folder, ck.folder)
    resuming = ck.enable and (ck.load_step >= 0 or any(root.glob("step-*")))
    if resuming or (ck.initial_load_path and not ck.initial_load_in_hf):
        _check_loaded_folder(job, plan, root, resuming)
    free = free_bytes(root) if ck.enable else 0
    if free is None:
        print(f"titan: {root} is object storage: no free-space check before saves", flush=True)
        return
    # the exact size needs the meta model (building one imports torch's compiler, a second);
    # a disk with room for any likely optimizer's save is passed without it
    if ck.enable and free < generous_save_bytes(plan.model_args.num_params()):
        from titan.assembly.build import training_save_bytes

        need = training_save_bytes(job, plan)
        why = space_problem(root, need)
        if why:
            raise ConfigError(why)


def _check_loaded_folder(job: JobConfig, plan, root: Path, resuming: bool) -> None:
    # DCP is imported only when there is a checkpoint to read: a fresh launch stays light
    from titan.assembly.build import run_identity
    from titan.components.checkpoint.folders import (
        CheckpointError,
        folder_problem,
        resume_candidate,
    )
    from titan.components.checkpoint.identity import INITIAL_LOAD_FIX, RESUME_FIX, refusal
    from titan.components.checkpoint.trained_with import resume_problem, trained_with

    ck = job.checkpoint
    identity = run_identity(job, plan)
    mode = "off" if ck.verify == "off" else "fast"
    try:
        path = None
        if resuming:
            path = resume_candidate(root, ck.load_step, lambda p: folder_problem(p, mode))
            if path is not None and (why := identity.problem(path, ck.allow_rope_change)):
                raise CheckpointError(refusal("cannot resume from", path, why, RESUME_FIX))
            ours = trained_with(job.optimizer.name, plan.tokenizer)
            if path is not None and (why := resume_problem(path, ours, ck.exclude_from_loading)):
                raise CheckpointError(f"cannot resume from {path}: {why}")
        if path is None and ck.initial_load_path and not ck.initial_load_in_hf:
            path = resolve(ck.initial_load_path)
            why = folder_problem(path, mode) if path.is_dir() else "does not exist"
            if why is None:
                why = identity.problem(path, ck.allow_rope_change, base=True)
            if why:
                raise CheckpointError(
                    refusal("checkpoint.initial_load_path", path, why, INITIAL_LOAD_FIX)
                )
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
