"""What the integration tests share: the common run settings, the numerics check against the
1-rank baseline, and the launch helpers (titan.tools.loss_compare's, on the test device).

The device: CPU/gloo by default; `TITAN_TEST_DEVICE=cuda` runs every launch on CUDA/NCCL
with one GPU per rank, and skips (saying why) a layout that needs more GPUs than there are.

A layout's numerics (`train_layout`) need no launch on CPU: its ranks are forked from the
test process (tests/forked.py: the same Trainer, without torchrun's start and each rank's
imports, half the cost). What only a launch proves (run_train.sh, the launcher's checks,
torchrun's restarts and signals, resume in a new job) is launched, on every layout kind the
checkpoint, fault-tolerance and multi-node tests cover. On CUDA every layout is launched.

Fixtures (`baseline`, `train_run`) live in conftest.py; tests import everything else here.
"""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from tests import workers
from tests.forked import free_port
from titan.tools import loss_compare
from titan.tools.loss_compare import (  # noqa: F401  re-exported for the tests
    RunFailed,
    compare,
    find_workers,
    format_table,
    kill_workers,
    read_metrics,
)

DEVICE = os.environ.get("TITAN_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"TITAN_TEST_DEVICE={DEVICE!r}: use cpu or cuda")


def require_devices(nproc: int) -> None:
    if DEVICE == "cuda":
        import torch

        if torch.cuda.device_count() < nproc:
            pytest.skip(f"needs {nproc} GPUs, this machine has {torch.cuda.device_count()}")


def launch(nproc, overrides, dump, **kw):
    """run_train.sh with NGPU=nproc on the test device (see loss_compare.launch), holding a
    core for each rank."""
    require_devices(nproc)
    with workers.busy(nproc):
        return loss_compare.launch(nproc, ["--training.device", DEVICE, *overrides], dump, **kw)


def command(nproc, overrides, dump, **kw):
    """The command line of a launch the test runs itself (inside `workers.busy(nproc)`)."""
    require_devices(nproc)
    return loss_compare.command(nproc, ["--training.device", DEVICE, *overrides], dump, **kw)


# MFU's CPU peak is a measured matmul, ~1 s per launch on a busy 2-core machine: tests that
# do not look at MFU give it instead
NO_PEAK_MEASUREMENT = ["--metrics.peak_flops", "1e12"]
# a small, fast setting for runs that test plumbing rather than learning
FAST = [
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
    "--training.mixed_precision_param",
    "float32",
    *NO_PEAK_MEASUREMENT,
]

# the numerics harness: every layout against one 1-rank run of the same seed and data, over
# the warm-up (3 steps) and as many steps of the decay: each step's loss and gradient norm
# are compared, and nothing in a step depends on more steps before it than these
STEPS = 6
GLOBAL_BATCH = 8
# CPU fp32 layouts match one process to ~1e-7; on CUDA, cuBLAS picks other kernels (split-K
# reductions) for sharded than for whole matmuls and NCCL sums in another order, so fp32
# differences there are larger: 1e-4 leaves room for them (not yet measured on a GPU)
RTOL = 1e-5 if DEVICE == "cpu" else 1e-4
SEQ_LEN = 64
COMMON = [
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    str(SEQ_LEN),
    "--training.mixed_precision_param",
    "float32",
    "--training.deterministic",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "3",
    "--metrics.no_enable_tensorboard",
    *NO_PEAK_MEASUREMENT,
]


def dp_batch(dp: int) -> list[str]:
    """Local batch that keeps the global batch at GLOBAL_BATCH sequences."""
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


def losses(dump) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


def train(nproc, overrides, dump, timeout=600) -> subprocess.CompletedProcess:
    """A run whose checkpoints, metrics and console (`stderr`: every rank's lines) a test
    reads, in `dump`: forked ranks on CPU (a resume is new processes reading the disk either
    way), a launch on CUDA. Refusals and exit codes, which only the launcher's path shows, are
    `launch`'s (a forked run that fails has failed the test already)."""
    if DEVICE == "cpu":
        import tempfile

        from tests.forked import rank_logs, run_trainer
        from titan.config.manager import with_config_file

        dump.parent.mkdir(parents=True, exist_ok=True)
        ranks = Path(tempfile.mkdtemp(prefix=f"{dump.name}-ranks-", dir=dump.parent))
        argv = with_config_file(overrides)
        run_trainer(ranks, nproc, argv, deadline_s=timeout, dump=dump)
        return subprocess.CompletedProcess(argv, 0, stdout="", stderr=rank_logs(ranks, nproc))
    return launch(nproc, overrides, dump, timeout=timeout)


def train_layout(nproc, overrides, tmp_path, timeout=600) -> list[dict]:
    """Rank 0's metrics records of a `train` run on `nproc` ranks, in `tmp_path/dump`."""
    train(nproc, overrides, tmp_path / "dump", timeout=timeout)
    return read_metrics(tmp_path / "dump")


def assert_matches_baseline(baseline, nproc, overrides, tmp_path, case, rtol=RTOL):
    records = train_layout(nproc, [*COMMON, *overrides], tmp_path)
    return assert_records_match(baseline, records, nproc, case, rtol)


def assert_records_match(baseline, records, nproc, case, rtol=RTOL):
    """Losses, global gradient norms and token counts of a `COMMON` run against the 1-rank
    baseline."""
    rows = compare(baseline, records, "loss")
    print(format_table(rows, "loss", "1 rank", f"{case} on {nproc} ranks"))
    assert len(rows) == STEPS
    assert max(d for *_, d in rows) <= rtol, format_table(rows, "loss", "1 rank", case)
    # the global gradient norm (over every shard, mesh dim and pipeline stage) matches too: on
    # CPU it is a float64 sum, so only the gradients' own last bits may differ (torch's float32
    # norm kernel needed 10x the bound, which hid a clipping factor 8e-5 off under FSDP)
    norms = compare(baseline, records, "grad_norm")
    assert max(d for *_, d in norms) <= rtol, format_table(norms, "grad_norm", "1 rank", case)
    assert_token_counts(records, nproc)
    return records


def assert_token_counts(records, nproc, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN):
    """Every step consumes the global batch, and each device is credited its share of it
    (context parallelism once counted its sharded batch, a factor cp too low)."""
    for r in records:
        assert r["tokens_seen"] == r["step"] * global_batch * seq_len, r
        # tps is tokens per device per second; one logged step per record here
        per_device = r["tps"] * r["step_time_s"]
        assert abs(per_device - global_batch * seq_len / nproc) < 1e-6 * per_device, r


# ----------------------------------------------------------------------------- several nodes


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun's workers run in sessions of their own, so a
    process group does not reach them)."""
    from pathlib import Path

    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return tree


class Nodes:
    """Simulated nodes on 127.0.0.1: one run_train.sh (one torchrun agent) per node, meeting
    through torchrun's c10d rendezvous. Node 0's agent hosts the rendezvous store, as the first
    node of a cluster does; a dead store host ends the job, any other node may die."""

    def __init__(
        self,
        count: int,
        nproc: int,
        overrides: list[str],
        dump,
        tmp_path,
        nnodes: str | None = None,
        env: dict | None = None,
        rdzv_conf: str = "",
    ):
        require_devices(count * nproc)  # on CUDA all "nodes" share this machine's GPUs
        self._cores = contextlib.ExitStack()
        self._cores.enter_context(workers.busy(count * nproc))
        port = free_port()
        self.procs, self.log_dirs = [], []
        for node in range(count):
            log_dir = tmp_path / f"node{node}_logs"
            conf = ",".join(c for c in (f"is_host={str(node == 0).lower()}", rdzv_conf) if c)
            cmd, full_env = command(
                nproc,
                overrides,
                dump,
                env={
                    "NNODES": nnodes or str(count),
                    "RDZV_ENDPOINT": f"127.0.0.1:{port}",
                    "RDZV_CONF": conf,
                    "PET_LOG_DIR": str(log_dir),
                    **(env or {}),
                },
            )
            if nnodes is None:  # a fixed node count: ranks in node order
                full_env["NODE_RANK"] = str(node)
            log_dir.mkdir(parents=True)
            # files, not pipes: a full pipe would block an agent that nobody reads yet
            with open(log_dir / "stdout", "w") as out, open(log_dir / "stderr", "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env=full_env,
                        cwd=loss_compare.REPO_ROOT,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
            self.log_dirs.append(log_dir)

    def kill(self, node: int) -> None:
        import signal

        for pid in process_tree(self.procs[node].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[node].wait()

    def wait(self, timeout: float = 600) -> list[tuple[int, str, str]]:
        """(exit code, stdout, stderr) of every node; fails with every rank's last lines."""
        import time

        deadline = time.monotonic() + timeout
        outs = []
        try:
            for p, d in zip(self.procs, self.log_dirs):
                p.wait(timeout=max(deadline - time.monotonic(), 1))
                outs.append((p.returncode, (d / "stdout").read_text(), (d / "stderr").read_text()))
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the nodes ran past {timeout}s; last lines of every rank:\n" + self.rank_tails()
            )
        finally:
            self.stop()
        return outs

    def rank_tails(self) -> str:
        return "\n".join(
            f"=== node {i}\n{loss_compare.rank_tails(d)}\n--- its agent:\n"
            + "\n".join((d / "stderr").read_text().splitlines()[-15:])
            for i, d in enumerate(self.log_dirs)
        )

    def stop(self) -> None:
        for node, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill(node)
        self._cores.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
