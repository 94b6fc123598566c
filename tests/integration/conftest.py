import pytest

from tests import workers
from tests.integration.harness import COMMON, STEPS, dp_batch, launch, read_metrics, train_layout


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


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """The 1-rank run every layout is compared with (one run for all of the suite's workers)."""

    def run():
        return train_layout(1, [*COMMON, *dp_batch(1)], tmp_path_factory.mktemp("baseline"))

    records = workers.once(tmp_path_factory, "baseline", run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it learns, so the curve says something
    return records
