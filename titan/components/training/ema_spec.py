"""The [ema] section (an exponential moving average of the weights), its checks and its
callback's registration; torch-free (the callback is titan.components.training.ema)."""

from dataclasses import dataclass

from titan.components.training.callbacks import CallbackSpec
from titan.config import extensions
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class EMA:
    enable: bool = opt(False, "Keep an exponential moving average of the weights (float32)")
    decay: float = opt(0.999, "Each update keeps this share of the average: avg = d avg + (1-d) w")
    start_step: int = opt(0, "Before this step the average is the weights themselves")
    every: int = opt(1, "Update the average every N steps from start_step")


def check(job) -> None:
    from titan.config.manager import require_all

    e = job.ema
    uses = {
        "validation.use_ema": job.validation.use_ema,
        "eval.use_ema": job.eval.use_ema,
        "checkpoint.export_ema": job.checkpoint.export_ema,
    }
    ck = job.checkpoint
    require_all(
        job,
        (
            (0 < e.decay < 1, "ema.decay", "must be in (0, 1)"),
            (e.start_step >= 0, "ema.start_step", "must be >= 0"),
            (e.every >= 1, "ema.every", "must be >= 1"),
            *(
                (e.enable or not on, key, "needs the average: set ema.enable")
                for key, on in uses.items()
            ),
            (
                not ck.export_ema or ck.last_save_model_only or ck.last_save_in_hf,
                "checkpoint.export_ema",
                "the last save must be an export (checkpoint.last_save_model_only or "
                "last_save_in_hf): a full checkpoint holds the weights training resumes from",
            ),
        ),
    )


def _copies(sections: dict) -> int:
    ema = sections.get("ema")
    return 1 if ema is not None and ema.enable else 0


register(
    CallbackSpec(
        "ema",
        build="titan.components.training.ema:build_callback",
        check=check,
        section="ema",
        options=EMA,
        weight_copies=_copies,
        ignored=lambda job: extensions.ignored_when(
            job, "ema", not job.ema.enable, "ema.enable is false", "enable"
        ),
    )
)
