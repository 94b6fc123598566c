import pytest

from titan.tools.loss_compare import launch, read_metrics

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
