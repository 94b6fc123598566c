"""What the suite's pytest-xdist workers share: the machine's cores, and results computed once.

Tests run on every core at once (`-n auto` in pyproject.toml), but a test that starts ranks
must not find them fighting another test's ranks for the cores: a rank slowed down that way
misses no result, but it stretches every collective and turns the suite's gain into a loss.
So the cores are slots, files locked with flock in a folder the controller makes, one per
core and one more:

- every test holds one slot while it runs (each worker computes on one thread, set below);
- a test that starts k busy processes (forked ranks, run_train.sh's ranks, simulated nodes)
  holds k slots (all of them, at most) for that while: `with busy(k):`, which the launch
  helpers of tests/forked.py and tests/integration/harness.py take for every test; a test
  that runs a launch itself calls `hold(k)` first (until it ends).

So the ranks of two tests never share the cores, and at most one single-process test runs
beside a multi-rank one, in the time its ranks spend waiting on each other. A test whose
assertions are timings holds every slot (`hold(ALL)`) and runs alone.

Waiting is deadlock-free: a worker queues for slots (under one mutex) only while it holds none,
so the slots it waits for are held by tests that are running, not waiting. The time a test
waited is recorded (`titan_core_wait_s`) and not counted against its time budget (conftest).

Without xdist, or with one worker, nothing is locked and nothing changes: `busy` is a no-op.

`once(tmp_path_factory, name, compute)`: a session-wide result (a reference run several test
files compare against) computed by the first worker that needs it, read by the others.
"""

import contextlib
import fcntl
import json
import os
import time

ENV = "TITAN_TEST_CORES"  # "<folder>:<slots>", set by the controller for its workers
ALL = 1 << 30  # hold(ALL): every slot, the test runs alone


def available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Slots:
    def __init__(self, folder: str, count: int):
        self.folder, self.count = folder, count
        self.held: list[int] = []
        self.waited = 0.0

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def acquire(self, k: int) -> None:
        """Hold k slots (1 <= k <= count); call with none held."""
        assert not self.held, "slots are taken with none held (or a waiter could deadlock)"
        k = max(1, min(k, self.count))
        start = time.monotonic()
        mutex = os.open(self._path("queue"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)  # one waiter at a time: no two half-served
            while True:
                for i in range(self.count):
                    if len(self.held) == k:
                        break
                    fd = os.open(self._path(f"core{i}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        continue
                    self.held.append(fd)
                if len(self.held) == k:
                    break
                time.sleep(0.02)
        finally:
            fcntl.flock(mutex, fcntl.LOCK_UN)
            os.close(mutex)
        self.waited += time.monotonic() - start

    def release(self) -> None:
        # LOCK_UN, not only close: a forked child still holding a copy of the descriptor
        # must not keep the slot
        for fd in self.held:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.held = []


_slots: Slots | None = None


def join(value: str) -> None:
    """In an xdist worker: share the cores described by the controller's `value`."""
    global _slots
    folder, _, count = value.rpartition(":")
    _slots = Slots(folder, int(count))


def start_test() -> None:
    if _slots is not None:
        _slots.acquire(1)
        _slots.waited = 0.0  # a test's time starts once it has its core


def waited() -> float:
    """Seconds the running test has waited for more cores."""
    return _slots.waited if _slots is not None else 0.0


def end_test() -> None:
    if _slots is not None:
        _slots.release()


def hold(processes: int) -> None:
    """Hold a slot for each of `processes` busy processes until the test ends (for a test
    that runs its own launches, e.g. to signal their ranks)."""
    if _slots is not None and min(processes, _slots.count) > len(_slots.held):
        _slots.release()
        _slots.acquire(processes)


@contextlib.contextmanager
def busy(processes: int):
    """Hold a slot for each of `processes` busy processes while the block runs (nested
    blocks keep the larger count)."""
    held = len(_slots.held) if _slots is not None else 0
    want = min(processes, _slots.count) if _slots is not None else 0
    if want <= held:
        yield
        return
    _slots.release()
    _slots.acquire(want)
    try:
        yield
    finally:
        _slots.release()
        if held:
            _slots.acquire(held)


def once(tmp_path_factory, name: str, compute):
    """compute() once per test session, whichever worker asks first; JSON results."""
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker <session folder>/popen-gwN: its parent is the session's own
    shared = base.parent if base.name.startswith("popen-gw") else base
    path = shared / f"{name}.json"
    lock = os.open(shared / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another worker computes it: wait without holding a core
            held = len(_slots.held) if _slots is not None else 0
            if held:
                _slots.release()
            fcntl.flock(lock, fcntl.LOCK_EX)
            if held:
                _slots.acquire(held)
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.rename(path)
        return result
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
