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


def _ended(failure) -> str:
    """How a worker process ended, from torchrun's record of it."""
    code = failure.exitcode
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _recorded(failure) -> str:
    """The first line of what a failed worker wrote of its own error (its error file: an
    exception's message, the watchdog's report), or "" where it wrote none."""
    if not os.path.isfile(failure.error_file):
        return ""
    message = failure.message
    if isinstance(message, dict):  # torch's @record writes {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    return lines[0] if lines else ""


def _stopped(failure) -> bool:
    """Whether a worker ended as one that torchrun stopped (SIGTERM), not by its own fault."""
    return failure.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)


def peer_failure() -> str | None:
    """On a worker stopped by SIGTERM: which rank's failure made torchrun stop the others
    (the launcher's agent writes it before it stops them), or None (a stop from outside:
    Ctrl-C, a scheduler, the user)."""
    path = os.environ.get(ENV)
    try:
        return Path(f"{path}.peers").read_text().strip() if path else None
    except OSError:
        return None


def read(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def one_line(entry: dict, max_restarts: int) -> str:
    why = " (not restarted: a restart would fail the same way)" if max_restarts else ""
    return f"titan: {entry['kind']} on rank {entry['rank']}: {entry['message']}{why}"


def run_torchrun(argv: list[str], stopped=None, reports: str | None = None) -> None:
    """torch.distributed.run's main with `argv`, stopping at a final error: then one line on
    stderr and the worker's exit code. Ctrl-C or SIGTERM: torchrun stops the workers, then
    one line (with `stopped()`: where the next run starts) and 128 + the signal. A rank that
    died (killed, or exited with an error no restart was left for): a few lines naming it,
    how it ended and where the next run starts, exit 1, torchrun's own report written in
    `reports` (a folder; without one, torchrun's failure is raised as it would)."""
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
        except ChildFailedError as failed:
            entry = read(path)
            if entry is None and reports is None:
                raise
            if entry is None:
                print(died(failed, reports, stopped, args.max_restarts), file=sys.stderr)
                sys.exit(1)
            print(one_line(entry, args.max_restarts), file=sys.stderr, flush=True)
            sys.exit(entry["exit_code"])

    try:
        supervised()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def died(failed, reports: str, stopped=None, max_restarts: int = 0) -> str:
    """The lines for ranks that ended with a failure (torchrun's ChildFailedError `failed`):
    which, how (a signal or an exit code), the restarts spent, where the next run starts;
    torchrun's whole report written to a file under `reports`, named."""
    import time

    # a rank a signal killed first: the others' errors are mostly what its loss caused them
    failures = sorted(failed.failures.items(), key=lambda rf: (rf[1].exitcode >= 0, rf[0]))
    own = [(rank, f) for rank, f in failures if not _stopped(f)] or failures
    first, *then = (f"rank {rank} {_ended(f)}" for rank, f in own)
    os.makedirs(reports, exist_ok=True)
    report = os.path.join(reports, f"rank_failure_{time.strftime('%Y%m%d-%H%M%S')}.txt")
    with open(report, "w") as f:
        f.write(failed.format_msg() + "\n")
    spent = f"after {max_restarts} restart(s) (MAX_RESTARTS)" if max_restarts else "MAX_RESTARTS=0"
    # what a rank recorded of its own failure (its exception, the watchdog's report)
    causes = [f"titan: rank {rank}: {_recorded(f)}" for rank, f in own if _recorded(f)]
    lines = [
        f"titan: the run ended: {first}"
        + (f" (then {', '.join(then)})" if then else "")
        + f"; {spent}",
        *causes,
        f"titan: {stopped()}" if stopped is not None else None,
        f"titan: each rank's own error is above; torchrun's report is in {report}",
    ]
    return "\n".join(line for line in lines if line)


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
            peers = Path(f"{path}.peers")
            if not result.is_failed() and peers.exists():
                peers.unlink()  # a restarted group runs: a later stop is not that failure's
            if result.is_failed():
                # before the agent stops the other ranks: their stop line names the cause
                failed = sorted(result.failures.items())
                named = ", ".join(f"rank {r} {_ended(f)}" for r, f in failed if not _stopped(f))
                peers.write_text(named + "\n")
                if os.path.exists(path):
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
