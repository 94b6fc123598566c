import logging
import os


def init_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=os.environ.get("TITAN_LOG_LEVEL", "INFO"),
        format=f"[titan rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
