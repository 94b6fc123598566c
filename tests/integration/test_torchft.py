"""torchft replica groups: two run_train.sh jobs that average gradients through torchft train
like one job with both batches, and a killed group heals from the live one and rejoins."""

import os
import signal
import subprocess
import time

import pytest

from tests import workers
from tests.integration.harness import COMMON, RTOL, STEPS, command, kill_workers, read_metrics

pytestmark = pytest.mark.needs("torchft")


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    def start(min_replicas):
        server = LighthouseServer(
            bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=10000, quorum_tick_ms=100
        )
        started.append(server)
        return server.address()

    started = []
    yield start
    for s in started:
        s.shutdown()


def ft_args(replica_id, min_replicas=1):
    return [
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id",
        str(replica_id),
        "--fault_tolerance.group_size",
        "2",
        "--fault_tolerance.min_replica_size",
        str(min_replicas),
        "--training.local_batch_size",
        "4",
        # a healing peer makes the live group miss one commit: wait 10 s for it, not 30
        "--fault_tolerance.timeout_seconds",
        "10",
    ]


def start_group(replica_id, address, dump, extra=(), min_replicas=1):
    # the two groups run side by side, and a heal waits out torchft's timeouts: alone
    workers.hold(workers.ALL)
    cmd, env = command(
        1,
        [*COMMON, *ft_args(replica_id, min_replicas), *extra],
        dump,
        env={"TORCHFT_LIGHTHOUSE": address},
    )
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(procs, dumps, timeout=400):
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p, d in zip(procs, dumps, strict=True):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            kill_workers(d)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return outs


def test_two_groups_train_like_one_job(lighthouse, baseline, tmp_path):
    address = lighthouse(min_replicas=2)
    dumps = [tmp_path / "g0", tmp_path / "g1"]
    finish([start_group(i, address, dumps[i], min_replicas=2) for i in range(2)], dumps)
    g0, g1 = (read_metrics(d) for d in dumps)
    assert [r["step"] for r in g0] == [r["step"] for r in g1] == list(range(1, STEPS + 1))
    for b, a, c in zip(baseline, g0, g1, strict=True):
        # each group logs the loss of its half of the global batch; the halves average to it
        assert abs((a["loss"] + c["loss"]) / 2 - b["loss"]) <= RTOL * b["loss"], b["step"]
        # and both step with the global gradient
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"]
        assert a["grad_norm"] == c["grad_norm"]


@pytest.mark.slow("two replica groups; a killed one restarts and heals through torchft's quorum")
def test_killed_group_heals_and_rejoins(lighthouse, tmp_path):
    address = lighthouse(min_replicas=1)
    slow = ["--training.steps", "24"]
    dumps = [tmp_path / "g0", tmp_path / "g1"]
    procs = [start_group(i, address, dumps[i], slow) for i in range(2)]
    deadline = time.monotonic() + 300
    while len(read_metrics(dumps[1])) < 5:
        assert procs[1].poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    kill_workers(dumps[1])  # the whole group dies
    procs[1].wait(timeout=60)
    survivor_at_kill = len(read_metrics(dumps[0]))
    procs[1] = start_group(1, address, dumps[1], slow)  # a fresh job for the group
    outs = finish(procs, dumps)
    g0 = {r["step"]: r for r in read_metrics(dumps[0])}
    g1 = {r["step"]: r for r in read_metrics(dumps[1])}
    # the live group never stopped (at start-up either group may heal once from the other)
    assert set(range(5, 25)) <= set(g0) and max(g0) == 24
    assert "healed from a live replica group" in outs[1][1]
    # the new job heals in its first or second step and jumps to the live group's step
    steps = sorted(g1)
    healed_from = next(s for s in steps if s > 5)
    assert set(steps[: steps.index(healed_from)]) <= {1}
    assert steps[steps.index(healed_from) :] == list(range(healed_from, 25))
    assert len(read_metrics(dumps[0])) >= survivor_at_kill
    # once rejoined, both groups step with the same averaged gradient
    for step in range(healed_from + 2, 25):
        assert g0[step]["grad_norm"] == g1[step]["grad_norm"], step
