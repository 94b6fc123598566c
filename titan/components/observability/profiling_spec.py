"""Profiling's [profiling] section (torch profiler traces and CUDA memory snapshots), its checks
and its two callbacks' registrations; torch-free (the callbacks are profiling.py and
memory_snapshot.py)."""

from dataclasses import dataclass

from titan.components.training.callbacks import CallbackSpec
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Collect torch profiler traces")
    save_traces_folder: str = opt("profile_traces", "Trace folder inside the dump folder")
    profile_freq: int = opt(10, "Profile one step out of every N")
    profiler_warmup: int = opt(3, "Profiler warmup steps before each traced step")
    profiler_active: int = opt(1, "Steps traced each time")
    enable_memory_snapshot: bool = opt(
        False,
        "Record the CUDA caching allocator's history and dump it every profile_freq "
        "steps and on an out-of-memory error (CUDA only; view at pytorch.org/memory_viz)",
    )
    memory_snapshot_start_step: int = opt(1, "The step from which the memory snapshot records")
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Memory snapshot folder inside the dump folder"
    )


def check(job) -> None:
    from titan.config.manager import require_all

    p = job.profiling
    require_all(
        job,
        (
            (p.profile_freq >= 1, "profiling.profile_freq", "must be >= 1"),
            (p.profiler_active >= 1, "profiling.profiler_active", "must be >= 1"),
            (
                # the trace's window; memory snapshots alone keep only profile_freq
                not p.enable_profiling
                or (
                    p.profiler_warmup >= 0
                    and p.profiler_warmup + p.profiler_active <= p.profile_freq
                ),
                "profiling.profiler_warmup",
                f"warmup + active ({p.profiler_active}) steps must fit in profiling.profile_freq "
                f"({p.profile_freq})",
            ),
            (
                p.memory_snapshot_start_step >= 1,
                "profiling.memory_snapshot_start_step",
                "steps count from 1",
            ),
        ),
    )


def check_device(job, plan) -> None:
    from titan.config.manager import require

    require(
        job,
        not job.profiling.enable_memory_snapshot or plan.device == "cuda",
        "profiling.enable_memory_snapshot",
        "records the CUDA caching allocator's history: it needs a GPU (training.device "
        "cuda). On CPU, python -m titan.planner plans each rank's bytes and every run "
        "writes what it held to memory_measured.json",
    )


_OWN = "titan.components.observability"
register(
    CallbackSpec(
        "profiler",
        build=f"{_OWN}.profiling:build_callback",
        check=check,
        section="profiling",
        options=Profiling,
        plan_check=check_device,
    )
)
register(CallbackSpec("memory_snapshot", build=f"{_OWN}.memory_snapshot:build_callback"))
