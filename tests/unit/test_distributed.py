"""Collective timeouts: the switch from the start-up limit to the (shorter) training limit,
and how a failed collective is told from other errors."""

import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests import workers
from tests.forked import run_workers
from titan.runtime.distributed import is_collective_failure, set_collective_timeout

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")


def _late_peer(rank, world_size):
    # the group starts with forked.py's 30 s limit; training steps get 1 s
    set_collective_timeout(1)
    if rank == 1:
        time.sleep(4)  # longer than the training limit, far shorter than the start-up one
        return {"late": True}
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001  the point of the test
        return {"failed_after": time.monotonic() - t0, "collective": is_collective_failure(e)}
    return {"failed_after": None}


def test_training_timeout_replaces_startup_timeout(tmp_path):
    workers.hold(workers.ALL)  # a timing: alone on the cores
    results = run_workers(_late_peer, 2, tmp_path, deadline_s=30, barrier=False)
    first = results[0]
    assert first["failed_after"] is not None and first["failed_after"] < 3, first
    assert first["collective"]


def test_other_errors_are_not_collective_failures():
    for error in (RuntimeError("CUDA out of memory"), ValueError("x"), KeyError("y")):
        try:
            raise error
        except Exception as e:  # noqa: BLE001
            assert not is_collective_failure(e)
    assert is_collective_failure(dist.DistBackendError("NCCL watchdog timeout"))
