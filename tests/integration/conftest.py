import pytest

from titan.tools.loss_compare import compare, format_table, launch, read_metrics

# a small, fast setting for runs that test plumbing rather than learning
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def train_run(tmp_path):
    """Launch run_train.sh; returns (CompletedProcess, metrics records, dump folder)."""

    def _run(nproc=1, *overrides, timeout=300, check=True, env=None, name="run"):
        dump = tmp_path / name
        proc = launch(nproc, list(overrides), dump, timeout=timeout, env=env, check=check)
        return proc, read_metrics(dump), dump

    return _run


# the numerics harness: every layout against one 1-rank run of the same seed and data
STEPS = 10
GLOBAL_BATCH = 8
RTOL = 1e-5
COMMON = ["--training.steps", str(STEPS), "--training.seq_len", "64",
          "--training.mixed_precision_param", "float32", "--training.deterministic",
          "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "3",
          "--metrics.no_enable_tensorboard"]


def dp_batch(dp: int) -> list[str]:
    """Local batch that keeps the global batch at GLOBAL_BATCH sequences."""
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    dump = tmp_path_factory.mktemp("baseline")
    launch(1, [*COMMON, *dp_batch(1)], dump, timeout=300)
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it learns, so the curve says something
    return records


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
    return records
