"""Shared test setup.

Tests never touch the network: the HF offline switches are set here, before any test
imports `datasets` / `huggingface_hub` (both read them once, at import time).

`python -m pytest` runs the tests on every core (pytest-xdist, `-n auto` in pyproject.toml),
whole files at a time (their module fixtures are computed once), longest first; the workers
share the cores through tests/workers.py, so ranks never outnumber them. Each test has a time
budget (BUDGET_S, its waits for cores excluded): a test that needs more says why with
`@pytest.mark.slow("why")`, and an unmarked test past it fails the session.

Every process a test starts runs with this interpreter's folder first on PATH (run_train.sh
calls `python`: an unactivated venv's `venv/bin/python -m pytest` launches that venv's ranks)
and with the optional-package guard of tests/import_guard: a test that imports an optional
package (directly, or through titan in a process it starts) declares it with
`@pytest.mark.needs("pkg")`, is skipped with the extra to install when the package is absent,
and the session fails if a test used one it did not declare.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

_GUARD_DIR = str(Path(__file__).resolve().parent / "import_guard")
_BIN = os.path.dirname(sys.executable)


def _prepend(var: str, entry: str) -> None:
    parts = [p for p in os.environ.get(var, "").split(os.pathsep) if p and p != entry]
    os.environ[var] = os.pathsep.join([entry, *parts])


_prepend("PATH", _BIN)
_prepend("PYTHONPATH", _GUARD_DIR)

import pytest  # noqa: E402

from tests import workers  # noqa: E402
from tests.import_guard import sitecustomize as guard  # noqa: E402
from titan.runtime.paths import REPO_ROOT  # noqa: E402

guard.install()

TOKENIZER_PATH = REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer():
    from titan.components.data.tokenizer import Tokenizer

    return Tokenizer(str(TOKENIZER_PATH))


# ------------------------------------------------------------------ disk
@pytest.fixture(scope="module", autouse=True)
def module_folders_removed(request, tmp_path_factory):
    """The folders a file's module fixtures made are removed when the file is done, unless one
    of its tests failed (kept to read). Passed tests' own tmp_path go at their teardown
    (pyproject's tmp_path_retention_policy): kept to the session's end, the checkpoints the
    suite writes add up to tens of GB, more than a CI machine may have free."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        return
    for path in set(base.iterdir()) - before:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ optional packages


def needed(item) -> set[str]:
    return {pkg for mark in item.iter_markers("needs") for pkg in mark.args}


def pytest_configure(config):
    fd, path = tempfile.mkstemp(prefix="titan-optional-imports-", suffix=".tsv")
    os.close(fd)
    os.environ["TITAN_TEST_IMPORT_LOG"] = config._titan_import_log = path
    share_cores(config)
    config._titan_cpu_start = cpu_seconds()


def pytest_runtest_setup(item):
    for pkg in sorted(needed(item)):
        if pkg not in guard.OPTIONAL:
            raise pytest.UsageError(
                f"needs({pkg!r}): not an optional package of "
                f"tests/import_guard ({', '.join(guard.OPTIONAL)})"
            )
        import importlib.util

        if importlib.util.find_spec(pkg) is None:
            pytest.skip(
                f"needs {pkg}: pip install -e '.[{guard.OPTIONAL[pkg]}]' "
                "(or '.[test]', which installs every optional package)"
            )


def undeclared_imports(items, log_path: str) -> list[str]:
    """'<test>: imports <pkg>' for every logged import of an optional package by a test
    whose `needs` marks do not name it."""
    by_id = {item.nodeid: item for item in items}
    seen, out = set(), []
    for line in Path(log_path).read_text().splitlines():
        test, _, pkg = line.partition("\t")
        item = by_id.get(test)
        if item is None or (test, pkg) in seen or pkg in needed(item):
            continue
        seen.add((test, pkg))
        out.append(f"{test}: imports {pkg} without @pytest.mark.needs({pkg!r})")
    return out


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller collects what each xdist worker found (each checks its own tests)."""
    out = getattr(node, "workeroutput", {})
    node.config._titan_worker_undeclared = [
        *getattr(node.config, "_titan_worker_undeclared", []),
        *out.get("titan_undeclared", []),
    ]


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    problems = list(getattr(config, "_titan_worker_undeclared", []))
    path = getattr(config, "_titan_import_log", None)
    if path is not None and os.path.exists(path):
        try:
            if not config.option.collectonly:
                problems += undeclared_imports(session.items, path)
        finally:
            os.unlink(path)
    if hasattr(config, "workerinput"):
        config.workeroutput["titan_undeclared"] = problems
        return
    config._titan_undeclared = problems
    over = over_budget(config)
    if (problems or over) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    problems = getattr(config, "_titan_undeclared", [])
    if problems:
        terminalreporter.section("optional packages used without a needs mark", red=True)
        for line in problems:
            terminalreporter.write_line(line)
    start, end = getattr(config, "_titan_cpu_start", None), cpu_seconds()
    if start and end and not hasattr(config, "workerinput"):
        (busy0, all0), (busy1, all1) = start, end
        cores = os.cpu_count() or 1
        terminalreporter.write_line(
            f"cores busy {100 * (busy1 - busy0) / max(all1 - all0, 1e-9):.0f}% of the session "
            f"({(busy1 - busy0) / 60:.1f} core-minutes of {(all1 - all0) / 60:.1f} on "
            f"{cores} cores; the whole machine, not only this session)"
        )
    over = over_budget(config)
    if over:
        terminalreporter.section(f"tests over the {budget(config):g} s budget", red=True)
        for nodeid, seconds in over:
            terminalreporter.write_line(
                f"{nodeid}: {seconds:.1f} s (cores awaited excluded); make it cheaper, or "
                '@pytest.mark.slow("why it needs longer")'
            )


# ------------------------------------------------------------------ every core, a time budget

# seconds a test may take (setup, call and teardown, its waits for cores excluded) unless it
# is marked slow: about 3x what the slowest unmarked tests take on a 2-core CI machine, so an
# unmarked test past it grew, not the machine (the ini option titan_budget_s overrides it)
BUDGET_S = 30.0
FILE_TIMES = Path(__file__).with_name("file_times.json")
_times: dict[str, float] = {}  # the controller's (or the only process's): seconds per test
_slow: set[str] = set()
_in_worker = False


def pytest_addoption(parser):
    parser.addini("titan_budget_s", "per-test time budget in seconds", default=str(BUDGET_S))


def budget(config) -> float:
    return float(config.getini("titan_budget_s"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    return workers.available()


def share_cores(config) -> None:
    """Controller: a slot per core and one more (tests/workers.py) for the workers, each
    computing on one thread.
    Worker: join them (its children do not: a nested pytest must not queue for them)."""
    global _in_worker
    _in_worker = hasattr(config, "workerinput")
    if _in_worker:
        if workers.ENV in os.environ:
            workers.join(os.environ.pop(workers.ENV))
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
        return
    if (getattr(config.option, "numprocesses", None) or 0) > 1:
        folder = tempfile.mkdtemp(prefix="titan-cores-")
        os.environ[workers.ENV] = f"{folder}:{workers.available() + 1}"
        os.environ["OMP_NUM_THREADS"] = "1"  # a slot is one core: 1-rank launches too


def pytest_collection_modifyitems(config, items):
    """In xdist's workers: the longest files first, each file's tests in their order, so
    loadscope hands them out in that order and no long file starts last (file_times.json:
    measured seconds per file; a file not in it counts 2 s a test)."""
    if not hasattr(config, "workerinput"):
        return
    try:
        known = json.loads(FILE_TIMES.read_text())
    except (OSError, ValueError):
        known = {}
    files = [item.nodeid.split("::")[0] for item in items]
    cost = {f: known.get(f, 2.0 * files.count(f)) for f in set(files)}
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])


def pytest_collection_finish(session):
    for item in session.items:
        mark = item.get_closest_marker("slow")
        if mark is not None and not (mark.args and isinstance(mark.args[0], str)):
            raise pytest.UsageError(f'{item.nodeid}: @pytest.mark.slow("why") names its reason')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    workers.start_test()
    try:
        yield
    finally:
        workers.end_test()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown":  # the test's last report carries what the budget needs
        item.user_properties.append(("titan_core_wait_s", workers.waited()))
        if item.get_closest_marker("slow") is not None:
            item.user_properties.append(("titan_slow", True))
    yield


def pytest_runtest_logreport(report):
    if _in_worker:
        return  # the controller counts, from the reports the workers send it
    _times[report.nodeid] = _times.get(report.nodeid, 0.0) + report.duration
    props = dict(report.user_properties)
    _times[report.nodeid] -= props.get("titan_core_wait_s", 0.0)
    if props.get("titan_slow"):
        _slow.add(report.nodeid)


def cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) core-seconds since boot, from /proc/stat (Linux only): where the suite's
    wall time goes, compute or idle cores."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def over_budget(config) -> list[tuple[str, float]]:
    """(test, seconds) of every unmarked test past the budget, longest first."""
    over = [(n, t) for n, t in _times.items() if t > budget(config) and n not in _slow]
    return sorted(over, key=lambda x: -x[1])
