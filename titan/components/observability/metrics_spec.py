"""The [metrics] section (what each logged step records and where it is written: the console,
metrics.jsonl, TensorBoard, W&B; per-rank step times and stragglers) and its checks;
torch-free (metrics.py, writers.py, rank_times.py)."""

from dataclasses import dataclass

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every N steps")
    enable_tensorboard: bool = opt(
        True, "Write TensorBoard events under <dump_folder>/<save_tb_folder>"
    )
    save_tb_folder: str = opt("tb", "TensorBoard folder inside the dump folder")
    peak_flops: float = opt(
        0.0,
        "Peak FLOP/s of one device for MFU; 0 = the GPU's datasheet peak (an unknown GPU: "
        "a measured bf16 matmul), and no MFU on CPU, which publishes no peak",
    )
    disable_color_printing: bool = opt(False, "Plain console output without ANSI colors")
    enable_wandb: bool = opt(
        False,
        "Log the same values as TensorBoard to Weights & Biases (pip install "
        "'titan[wandb]'; WANDB_MODE=offline keeps the run on disk under the dump folder)",
    )
    wandb_project: str = opt("titan", "W&B project")
    wandb_run_name: str | None = opt(None, "W&B run name; None = the dump folder's name")
    wandb_entity: str | None = opt(None, "W&B entity (team or user); None = the login's default")
    wandb_tags: list[str] = opt([], "W&B run tags")
    per_rank: bool = opt(
        True,
        "Every log step, gather each rank's own step time (its wall time less its waits "
        "for other ranks) and data wait; log the slowest rank and the spread",
    )
    straggler_threshold: float = opt(
        0.2, "Warn when a rank's own step time exceeds the median's by more than this fraction"
    )
    straggler_log_steps: int = opt(
        3, "... for this many consecutive log steps (one warning per episode)"
    )


def check(job) -> None:
    from titan.config.manager import require_all

    m = job.metrics
    require_all(
        job,
        (
            (m.log_freq >= 1, "metrics.log_freq", "must be >= 1"),
            (m.peak_flops >= 0, "metrics.peak_flops", "must be >= 0 (0 = automatic)"),
            (
                m.straggler_threshold > 0,
                "metrics.straggler_threshold",
                "a fraction above the median step time, e.g. 0.2",
            ),
            (
                m.straggler_log_steps >= 1,
                "metrics.straggler_log_steps",
                "consecutive log steps before a warning: 1 or more",
            ),
        ),
    )


register(Entry("metrics", section="metrics", options=Metrics, check=check))
