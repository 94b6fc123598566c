"""Shared test setup.

Tests never touch the network: the HF offline switches are set here, before any test
imports `datasets` / `huggingface_hub` (both read them once, at import time).

Every process a test starts runs with this interpreter's folder first on PATH (run_train.sh
calls `python`: an unactivated venv's `venv/bin/python -m pytest` launches that venv's ranks)
and with the optional-package guard of tests/import_guard: a test that imports an optional
package (directly, or through titan in a process it starts) declares it with
`@pytest.mark.needs("pkg")`, is skipped with the extra to install when the package is absent,
and the session fails if a test used one it did not declare.
"""

import os
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

from tests.import_guard import sitecustomize as guard  # noqa: E402
from titan.runtime.paths import REPO_ROOT  # noqa: E402

guard.install()

TOKENIZER_PATH = REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer():
    from titan.components.data.tokenizer import Tokenizer

    return Tokenizer(str(TOKENIZER_PATH))


# ------------------------------------------------------------------ optional packages


def needed(item) -> set[str]:
    return {pkg for mark in item.iter_markers("needs") for pkg in mark.args}


def pytest_configure(config):
    fd, path = tempfile.mkstemp(prefix="titan-optional-imports-", suffix=".tsv")
    os.close(fd)
    os.environ["TITAN_TEST_IMPORT_LOG"] = config._titan_import_log = path


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


def pytest_sessionfinish(session, exitstatus):
    path = getattr(session.config, "_titan_import_log", None)
    if path is None or not os.path.exists(path):
        return
    try:
        if not session.config.option.collectonly:
            problems = undeclared_imports(session.items, path)
            session.config._titan_undeclared = problems
            if problems and session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        os.unlink(path)


def pytest_terminal_summary(terminalreporter, config):
    problems = getattr(config, "_titan_undeclared", [])
    if problems:
        terminalreporter.section("optional packages used without a needs mark", red=True)
        for line in problems:
            terminalreporter.write_line(line)
