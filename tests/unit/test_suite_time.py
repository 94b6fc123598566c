"""The suite's own time: its workers share the cores without outnumbering them
(tests/workers.py), and a test past the per-test budget fails the session unless it says
why it needs longer (tests/conftest.py)."""

import os
import subprocess
import sys
import threading
import time

import pytest

from tests import workers
from titan.runtime.paths import REPO_ROOT

TIMED = """
import time
import pytest

def test_quick():
    pass

def test_over():
    time.sleep(1.5)

@pytest.mark.slow("sleeps on purpose")
def test_marked():
    time.sleep(1.5)
"""

UNSAID = """
import pytest

@pytest.mark.slow
def test_no_reason():
    pass
"""


def pytest_child(tmp_path, source, *args):
    test_file = tmp_path / "test_timed.py"
    test_file.write_text(source)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-c",
            "pyproject.toml",
            "-p",
            "tests.conftest",
            "-q",
            *args,
            str(test_file),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["one_process", "two_workers"])
def test_an_unmarked_test_past_the_budget_fails_the_session(xdist, tmp_path):
    proc = pytest_child(tmp_path, TIMED, "-o", "titan_budget_s=1", *xdist)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 passed" in proc.stdout
    section = proc.stdout.split("tests over the 1 s budget", 1)[1]
    lines = [ln for ln in section.splitlines() if "::test_" in ln]
    assert len(lines) == 1 and "::test_over: 1." in lines[0], lines
    assert '@pytest.mark.slow("why it needs longer")' in lines[0]
    # within the budget, all pass
    proc = pytest_child(tmp_path, TIMED, "-o", "titan_budget_s=5", *xdist)
    assert proc.returncode == 0 and "tests over" not in proc.stdout, proc.stdout[-3000:]


def test_a_slow_mark_names_its_reason(tmp_path):
    proc = pytest_child(tmp_path, UNSAID)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert '@pytest.mark.slow("why") names its reason' in proc.stderr


def test_slots_are_shared_without_outnumbering_the_cores(tmp_path):
    """Two workers' views of a 2-core machine (3 slots: a core each and one more): a
    single-process test runs beside a 2-rank one, two 2-rank tests wait for each other, and
    4 ranks take every slot."""
    slots = [workers.Slots(str(tmp_path), 3) for _ in range(3)]
    a, b, c = slots

    def acquired(s: workers.Slots, k: int) -> threading.Thread:
        t = threading.Thread(target=s.acquire, args=(k,))
        t.start()
        t.join(timeout=0.5)
        return t

    a.acquire(1)
    assert not acquired(b, 2).is_alive() and len(b.held) == 2  # 1 + 2 ranks fit
    waiting = acquired(c, 2)  # a second 2-rank test would share the cores: it waits
    assert waiting.is_alive() and not c.held
    b.release()
    waiting.join(timeout=10)
    assert len(c.held) == 2 and c.waited >= 0.4
    c.release()
    a.release()
    a.acquire(4)
    assert len(a.held) == 3  # every slot, at most
    waiting = acquired(b, 1)
    assert waiting.is_alive()  # nothing beside 4 ranks
    a.release()
    waiting.join(timeout=10)
    assert len(b.held) == 1
    b.release()


def test_a_forked_child_does_not_keep_its_parents_slot(tmp_path):
    """Slots are released with LOCK_UN, so a child forked while the slot was held (a rank
    that outlives its test, a helper process) does not keep the core."""
    a = workers.Slots(str(tmp_path), 1)
    a.acquire(1)
    pid = os.fork()
    if pid == 0:  # the child holds the same descriptor
        time.sleep(3)
        os._exit(0)
    try:
        a.release()
        b = workers.Slots(str(tmp_path), 1)
        start = time.monotonic()
        b.acquire(1)
        assert time.monotonic() - start < 1
        b.release()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
