"""The console format of every titan process, and the library chatter kept out of it."""

import logging
import os


def _not_library_info(record: logging.LogRecord) -> bool:
    """Drop what libraries log below WARNING on the root logger (DCP's saving process:
    'Received async checkpoint request ...'): titan's own lines say what a user needs."""
    return (
        record.levelno >= logging.WARNING
        or record.name != "root"
        or f"{os.sep}torch{os.sep}" not in record.pathname
    )


STORE_CLIENTS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google.auth")


def init_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=os.environ.get("TITAN_LOG_LEVEL", "INFO"),
        format=f"[titan rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    _quiet_libraries()


def quiet_checkpoint_process() -> None:
    """In DCP's saving process (spawned from titan.trainer.train, which it imports first): its
    INFO lines, in a format of their own, and the warning every staged DTensor's mesh gives as it
    is unpickled before the process's groups exist (harmless: it never compiles)."""
    _quiet_libraries()
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)


def _quiet_libraries() -> None:
    logging.getLogger().addFilter(_not_library_info)
    # an object store's client says at INFO where it found credentials, once a process
    for name in STORE_CLIENTS:
        logging.getLogger(name).setLevel(logging.WARNING)
