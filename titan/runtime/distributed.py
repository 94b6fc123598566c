"""Process-group life cycle: device choice, init with timeouts, and a clean exit."""

import datetime
import logging
import os
import socket
import sys

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def pick_device(kind: str = "auto") -> torch.device:
    """This rank's device: `kind` "cuda", "cpu", or "auto" (CUDA when a GPU is visible)."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device, init_timeout_s: int) -> tuple[int, int]:
    """Always a process group, world size 1 included, so one code path serves 1 and N ranks."""
    if "RANK" not in os.environ:  # started as plain `python -m titan.trainer`
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # gloo beside nccl lets CPU tensors (checkpoint metadata, timing) use collectives too
        backend = "cuda:nccl,cpu:gloo"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(seconds=init_timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        # after a torchrun restart, gloo would read the dead attempt's peer addresses from the
        # agent's store and hang connecting to them: give every attempt its own key space
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"titan/attempt_{attempt}", store)
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    return dist.get_rank(), dist.get_world_size()


def is_collective_failure(error: BaseException) -> bool:
    """Did `error` come out of a collective or p2p call (a timeout, or a peer that died)?

    NCCL raises torch's DistError types. gloo raises a plain RuntimeError from inside the
    collective's wait, so there the type and the innermost frame of the traceback (in
    torch.distributed) tell.
    """
    if isinstance(error, dist.DistError):
        return True
    if type(error) is not RuntimeError:
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of every rank's `value` (collective where there are several ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor(value, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def set_collective_timeout(seconds: int) -> None:
    """Shorten the timeout once the first step has run (init and compile are slow, steps not)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds), None)


def clean_exit(code: int) -> None:
    """End the worker without letting gloo's threads race the interpreter's finalization.

    Letting Python exit normally aborts in ~15% of gloo runs; barrier -> destroy ->
    flush -> os._exit does not.
    """
    if dist.is_initialized():
        try:
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001  exiting anyway; say why once
            logger.warning("process group teardown failed: %s", e)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
