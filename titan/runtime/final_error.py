"""Errors a restart would meet again (bad data, a bad checkpoint, a config a worker refuses,
a diverged loss), carried from the worker that found one to the launcher.

torchrun's agent restarts the worker group on any failure, `--max-restarts` times: a
deterministic error was met MAX_RESTARTS + 1 times, each ending in a traceback per rank and
torchrun's failure report. Instead the launcher names a file in TITAN_ERROR_FILE; a worker
that meets such an error writes it there before exiting; the launcher's agent, seeing a
failure while that file exists, restarts no more (as torch's own agent does for a worker
stuck in uninterruptible sleep), and the launcher prints the error as one line and exits
with the worker's code. Any other failure (a killed rank, a collective timeout) is restarted
and reported as before. Workers started without titan's launcher (plain torchrun) get no
file and are restarted as torchrun decides.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

ENV = "TITAN_ERROR_FILE"
PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def describe(signum: int) -> str:
    """A signal as a stop line names it."""
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


def record(kind: str, error: BaseException | str, exit_code: int) -> None:
    """Hand the error to the launcher, if one asked; the first rank to write wins (later
    ones mostly report the first one's consequences)."""
    path = os.environ.get(ENV)
    if not path:
        return
    entry = {
        "kind": kind,
        "message": " ".join(str(error).split()),
        "exit_code": exit_code,
        "rank": int(os.environ.get("RANK", "0")),
    }
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(entry, f)
    try:
        os.link(tmp, path)  # atomic and exclusive: the launcher never reads half a file
    except FileExistsError:
        pass
    finally:
        os.remove(tmp)


def read(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def one_line(entry: dict, max_restarts: int) -> str:
    why = " (not restarted: a restart would fail the same way)" if max_restarts else ""
    return f"titan: {entry['kind']} on rank {entry['rank']}: {entry['message']}{why}"


def run_torchrun(argv: list[str], stopped=None) -> None:
    """torch.distributed.run's main with `argv`, stopping at a final error: then one line on
    stderr and the worker's exit code. Ctrl-C or SIGTERM: torchrun stops the workers, then
    one line (with `stopped()`: where the next run starts) and 128 + the signal. Other
    failures end as torchrun's own do."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    args = torchrun.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="titan-launch-")
    path = os.path.join(folder, "final_error.json")
    os.environ[ENV] = path  # the workers inherit it

    @record  # as torchrun's main: a parent torchelastic gets the root cause of other failures
    def supervised() -> None:
        try:
            with _agents_stopping_at(path):
                torchrun.run(args)
        except SignalException as e:
            where = f"; {stopped()}" if stopped is not None else ""
            print(f"titan: stopped by {describe(e.sigval)}{where}", file=sys.stderr, flush=True)
            sys.exit(128 + int(e.sigval))
        except ChildFailedError:
            entry = read(path)
            if entry is None:
                raise
            print(one_line(entry, args.max_restarts), file=sys.stderr, flush=True)
            sys.exit(entry["exit_code"])

    try:
        supervised()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _agents_stopping_at(path: str):
    """Within, torchrun's launcher builds agents that restart no more once `path` exists.
    launch_agent names its agent class as a module global and takes none as a parameter;
    this launcher process runs nothing else meanwhile."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent

    class Agent(original):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed() and os.path.exists(path):
                self._remaining_restarts = 0  # _invoke_run then stops the group
            return result

    def quiet(record: logging.LogRecord) -> bool:
        # its "failed (exitcode: 2) local_rank: 0 ..." and "Sending process ... SIGTERM"
        # lines say less than the one line the launcher prints; so do "Received 2 death
        # signal" and the closing signals sent to the workers on Ctrl-C or SIGTERM
        stopping = any(s in str(record.msg) for s in ("death signal", "closing signal"))
        return not (stopping or os.path.exists(path))

    logs = [logging.getLogger(name) for name in (PROCESS_LOGGER, AGENT_LOGGER)]
    launcher_api.LocalElasticAgent = Agent
    for log in logs:
        log.addFilter(quiet)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original
        for log in logs:
            log.removeFilter(quiet)
