"""What the observability settings need, checked before launch."""

from titan.config import JobConfig
from titan.config.manager import require


def check_observability(job: JobConfig, device: str) -> None:
    """`device`: "cuda" or "cpu", the run's device type."""
    p = job.profiling
    require(
        job,
        not p.enable_memory_snapshot or device == "cuda",
        "profiling.enable_memory_snapshot",
        "records the CUDA caching allocator's history: it needs a GPU (training.device "
        "cuda). On CPU, python -m titan.planner plans each rank's bytes and every run "
        "writes what it held to memory_measured.json",
    )
    require(
        job,
        p.memory_snapshot_start_step >= 1,
        "profiling.memory_snapshot_start_step",
        "steps count from 1",
    )
    m = job.metrics
    require(
        job,
        m.straggler_threshold > 0,
        "metrics.straggler_threshold",
        "a fraction above the median step time, e.g. 0.2",
    )
    require(
        job,
        m.straggler_log_steps >= 1,
        "metrics.straggler_log_steps",
        "consecutive log steps before a warning: 1 or more",
    )
    require(
        job,
        job.comm.trace_buf_size >= 0,
        "comm.trace_buf_size",
        "the flight recorder keeps that many collectives: 0 (off) or more",
    )
