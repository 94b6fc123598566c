"""The suite on a machine without the optional packages, and from a venv that is not
activated: what a user who copies the README's commands meets.

- with every optional package hidden (tests/import_guard), the whole suite collects and each
  test marked `needs` skips, naming the extra that installs what it needs;
- a test that imports an optional package (itself or in a process it starts) without the
  mark fails the session, so the marks cannot fall behind the code;
- `venv/bin/python -m pytest` with the venv not on PATH still launches run_train.sh with
  that venv's interpreter.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.import_guard.sitecustomize import OPTIONAL
from titan.runtime.paths import REPO_ROOT


def pytest_child(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    # without the project's addopts (-ra, --durations): only what each test asks for
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def summary_counts(stdout: str) -> dict[str, int]:
    last = stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last)}


def test_without_optional_packages_the_suite_collects_and_their_tests_skip():
    env = {**os.environ, "TITAN_TEST_HIDE": ",".join(OPTIONAL)}
    proc = pytest_child(["-q", "-rs", "-m", "needs", "tests"], env, timeout=600)
    counts = summary_counts(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # nothing ran: every selected test skipped, none errored at collection
    assert counts.get("skipped", 0) >= 20 and set(counts) <= {"skipped", "deselected"}, counts
    reasons = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", proc.stdout)
    assert all(
        re.fullmatch(
            r"needs (\w+): pip install -e '\.\[\w+\]' \(or '\.\[test\]', which "
            r"installs every optional package\)",
            r,
        )
        for r in reasons
    ), reasons
    assert {re.match(r"needs (\w+)", r).group(1) for r in reasons} == set(OPTIONAL)


USES = """
import subprocess, sys
import pytest

def test_declares_it():
    pytest.importorskip("matplotlib")

@pytest.mark.needs("matplotlib")
def test_declares_it_too():
    subprocess.run([sys.executable, "-c", "import matplotlib"], check=True)

def test_forgets_it():
    subprocess.run([sys.executable, "-c", "import matplotlib.pyplot"], check=True)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "two_workers"])
def test_an_optional_import_without_its_mark_fails_the_session(workers, tmp_path):
    """Also when xdist's workers ran the tests: each checks its own, the controller fails."""
    test_file = tmp_path / "test_uses.py"
    test_file.write_text(USES)
    proc = pytest_child(
        ["-q", "-c", "pyproject.toml", "-p", "tests.conftest", *workers, str(test_file)],
        dict(os.environ),
        timeout=120,
    )
    assert summary_counts(proc.stdout) == {"passed": 3}, proc.stdout
    assert proc.returncode == 1, proc.stdout
    section = proc.stdout.split("optional packages used without a needs mark", 1)[1]
    section = section.split("\n=", 1)[0]
    # pytest.importorskip's own import is pytest's, not the test's code: only what the test
    # ran in a process of its own is reported, and the marked one is not
    assert "test_forgets_it: imports matplotlib without @pytest.mark.needs('matplotlib')" in section
    assert "test_declares_it" not in section


def test_an_unactivated_venv_launches_run_train_sh_with_its_own_python():
    # PATH without this interpreter's folder, as when venv/bin/python is called by its path
    path = os.pathsep.join(p for p in ["/usr/bin", "/bin"] if os.path.isdir(p))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = pytest_child(
        ["-q", "tests/unit/test_launch_env.py", "-k", "refuses_bad_env"],
        {**env, "PATH": path},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert summary_counts(proc.stdout) == {"passed": 6, "deselected": 6}
