"""Validation's [validation] section, its checks and its callback's registration; torch-free
(the validator is titan.components.training.validate)."""

from dataclasses import dataclass

from titan.components.training.callbacks import CallbackSpec
from titan.config import extensions
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate loss on a held-out dataset during training")
    dataset: str = opt("kjv_valid", "Validation dataset (same forms as training.dataset)")
    dataset_path: str | None = opt(None, "Local path that overrides where the dataset is read from")
    dataset_streaming: bool = opt(False, "Stream local files (as training.dataset_streaming)")
    freq: int = opt(500, "Validate every N steps (and after the last step)")
    steps: int = opt(-1, "Validation batches per validation; -1 = one full pass over the dataset")
    global_batch_size: int = opt(
        -1,
        "Sequences per validation batch over all data-parallel ranks, each taking an equal "
        "share: the same sequences, so the same val_loss, on every layout; -1: "
        "local_batch_size x dp (then val_loss depends on dp)",
    )
    local_batch_size: int = opt(
        -1,
        "Sequences per forward on each data-parallel rank (a rank's share of a validation "
        "batch may take several); -1: its whole share (8 when global_batch_size is -1 too)",
    )
    use_ema: bool = opt(False, "Validate the average of the weights ([ema]) instead of them")


def check(job) -> None:
    from titan.config.manager import require_all

    v = job.validation
    require_all(
        job,
        (
            (v.freq >= 1, "validation.freq", "must be >= 1"),
            (v.steps == -1 or v.steps >= 1, "validation.steps", "must be -1 (full pass) or >= 1"),
            (
                v.local_batch_size >= 1 or v.local_batch_size == -1,
                "validation.local_batch_size",
                "must be >= 1, or -1 (each rank's whole share of a validation batch)",
            ),
            (
                v.global_batch_size >= 1 or v.global_batch_size == -1,
                "validation.global_batch_size",
                "must be >= 1, or -1 (local_batch_size x dp)",
            ),
        ),
    )


def check_batches(job, plan) -> None:
    """A validation batch splits evenly over the data-parallel ranks and their forwards."""
    from titan.config.manager import require

    v, dp = job.validation, plan.data_parallel_size
    if not v.enable or v.global_batch_size == -1:
        return
    require(
        job,
        v.global_batch_size % dp == 0,
        "validation.global_batch_size",
        f"must split evenly over the {dp} data-parallel ranks: pick a multiple of {dp}",
    )
    share = v.global_batch_size // dp
    require(
        job,
        v.local_batch_size == -1 or share % v.local_batch_size == 0,
        "validation.local_batch_size",
        f"must divide each rank's share of a validation batch, global_batch_size / dp = "
        f"{v.global_batch_size} / {dp} = {share}",
    )


register(
    CallbackSpec(
        "validation",
        build="titan.components.training.validate:build_callback",
        check=check,
        section="validation",
        options=Validation,
        plan_check=check_batches,
        ignored=lambda job: extensions.ignored_when(
            job, "validation", not job.validation.enable, "validation.enable is false", "enable"
        ),
    )
)
