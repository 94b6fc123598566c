"""What the integration tests share: the common run settings, the numerics check against the
1-rank baseline, and the launch helpers (from titan.tools.loss_compare, the CLI's harness).

Fixtures (`baseline`, `train_run`) live in conftest.py; tests import everything else here.
"""

from titan.tools.loss_compare import (  # noqa: F401  re-exported for the tests
    RunFailed,
    command,
    compare,
    find_workers,
    format_table,
    kill_workers,
    launch,
    read_metrics,
)

# a small, fast setting for runs that test plumbing rather than learning
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]

# the numerics harness: every layout against one 1-rank run of the same seed and data
STEPS = 10
GLOBAL_BATCH = 8
RTOL = 1e-5
SEQ_LEN = 64
COMMON = ["--training.steps", str(STEPS), "--training.seq_len", str(SEQ_LEN),
          "--training.mixed_precision_param", "float32", "--training.deterministic",
          "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "3",
          "--metrics.no_enable_tensorboard"]


def dp_batch(dp: int) -> list[str]:
    """Local batch that keeps the global batch at GLOBAL_BATCH sequences."""
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


def losses(dump) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


def assert_matches_baseline(baseline, nproc, overrides, dump, case, rtol=RTOL):
    launch(nproc, [*COMMON, *overrides], dump, timeout=600)
    records = read_metrics(dump)
    rows = compare(baseline, records, "loss")
    print(format_table(rows, "loss", "1 rank", f"{case} on {nproc} ranks"))
    assert len(rows) == STEPS
    assert max(d for *_, d in rows) <= rtol, format_table(rows, "loss", "1 rank", case)
    # the global gradient norm (over every shard, mesh dim and pipeline stage) matches too
    norms = compare(baseline, records, "grad_norm")
    assert max(d for *_, d in norms) <= 10 * rtol, format_table(norms, "grad_norm", "1 rank", case)
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
