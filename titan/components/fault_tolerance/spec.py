"""torchft's [fault_tolerance] section and its checks; torch-free (the replica groups are
torchft_groups.py)."""

from dataclasses import dataclass

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False,
        "torchft replica groups: each group is its own run_train.sh job; needs "
        "pip install torchft and a lighthouse at TORCHFT_LIGHTHOUSE",
    )
    replica_id: int = opt(0, "This group's id, 0 .. group_size-1")
    group_size: int = opt(1, "Number of replica groups (they average gradients through torchft)")
    min_replica_size: int = opt(1, "Fewest live groups that may commit a step")
    timeout_seconds: int = opt(30, "torchft collective/quorum timeout (quorum gets 3x)")


def check(job) -> None:
    from titan.config.manager import require

    ft = job.fault_tolerance
    if not ft.enable:
        return
    require(
        job,
        0 <= ft.replica_id < ft.group_size,
        "fault_tolerance.replica_id",
        f"must lie in [0, fault_tolerance.group_size = {ft.group_size})",
    )
    require(
        job,
        1 <= ft.min_replica_size <= ft.group_size,
        "fault_tolerance.min_replica_size",
        f"must lie in [1, fault_tolerance.group_size = {ft.group_size}]",
    )


def check_plan(job, plan) -> None:
    """The layout torchft's groups can replicate, torchft itself and its lighthouse."""
    import os

    from titan.config import ConfigError
    from titan.config.manager import require

    if not job.fault_tolerance.enable:
        return
    require(
        job,
        plan.dims.dp_replicate == 1,
        "parallelism.data_parallel_replicate_degree",
        "must be 1 with fault_tolerance: the torchft replica groups are the replicate dim",
    )
    require(
        job,
        not plan.dims.pp_enabled,
        "parallelism.pipeline_parallel_degree",
        "pipeline parallelism is not supported with fault_tolerance yet; set it to 1",
    )
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(
            "fault_tolerance.enable needs torchft: pip install -e '.[torchft]'"
        ) from None
    if not os.environ.get("TORCHFT_LIGHTHOUSE"):
        raise ConfigError(
            "fault_tolerance.enable needs a torchft lighthouse: start `torchft_lighthouse "
            "--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000` and set "
            "TORCHFT_LIGHTHOUSE=http://HOST:29510 for every replica group"
        )


register(
    Entry(
        "fault_tolerance",
        section="fault_tolerance",
        options=FaultTolerance,
        check=check,
        plan_check=check_plan,
    )
)
