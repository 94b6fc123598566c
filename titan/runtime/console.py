"""Output of titan's command-line tools: into a pipe that may close early (`| head`), and
counts in words."""

import os
import signal
import sys


def print_out(text: str) -> None:
    """print(text); when the reader has gone (`./run_train.sh --help | head`), end quietly
    with the status a shell gives a tool killed by SIGPIPE (141), not a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # the unwritten rest is still buffered: flushed again at exit, it would raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)


def plural(n: int, word: str) -> str:
    """ "1 step", "2 steps"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
