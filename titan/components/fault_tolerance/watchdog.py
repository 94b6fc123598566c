"""Turn a stuck rank into an error: if no progress is reported for `timeout` seconds, dump
every thread's stack (to stderr and a file) and exit, so torchrun ends or restarts the job
instead of waiting forever.

A rank that is merely waiting inside a collective for a stuck peer is left to the collective
timeout (up to twice the limit): that way the report comes from the rank that is stuck.
"""

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

logger = logging.getLogger(__name__)

EXIT_CODE = 86  # distinct from crashes (1) and config errors (2) in torchrun's report


class WatchdogTimeout(RuntimeError):
    pass


class StepWatchdog:
    def __init__(self, timeout_s: float, rank: int, dump_folder: str):
        self.timeout_s, self.rank, self.dump_folder = timeout_s, rank, dump_folder
        self._last = time.monotonic()
        self._where = "start-up"
        self._stop = threading.Event()
        self._paused = False
        self._thread = threading.Thread(target=self._run, name="titan-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def progress(self, where: str) -> None:
        self._last, self._where = time.monotonic(), where

    @contextlib.contextmanager
    def paused(self):
        """For work that may legitimately outlast a step (a checkpoint save); collective
        timeouts still catch a hang inside it."""
        self._paused = True
        try:
            yield
        finally:
            self._last, self._paused = time.monotonic(), False

    def _run(self) -> None:
        while not self._stop.wait(min(0.5, self.timeout_s / 8)):
            idle = time.monotonic() - self._last
            if self._paused or idle <= self.timeout_s:
                continue
            if idle > 2 * self.timeout_s or not self._waiting_on_peers():
                self._fire(idle)

    def _waiting_on_peers(self) -> bool:
        """Is the main thread blocked inside torch.distributed (a collective or p2p op)?"""
        frame = sys._current_frames().get(threading.main_thread().ident)
        return frame is not None and f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename

    def _fire(self, idle: float) -> None:
        folder = os.path.join(self.dump_folder, "watchdog")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_stacks.txt")
        msg = (
            f"rank {self.rank}: no training progress for {idle:.0f}s (80% of "
            f"comm.train_timeout_seconds) after {self._where}; "
            f"stacks of all threads follow and are saved in {path}"
        )
        logger.error(msg)
        with open(path, "w") as f:
            f.write(msg + "\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        # the main thread is stuck, so @record around it never sees this: write torchrun's
        # error file from here. Its summary prints the recorded traceback, so raise first:
        # the traceback then ends in this message
        try:
            raise WatchdogTimeout(msg)
        except WatchdogTimeout as e:
            ErrorHandler().record_exception(e)
        os._exit(EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()
