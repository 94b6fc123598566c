"""Module names users typed before the house was reorganised keep running what they name
now, and say its new name once (on rank 0 of a launch)."""

import os
import runpy
import sys


def run_moved(old: str, new: str, called: str | None = None) -> None:
    """`python -m <old>`: run module `new` as the main module, with the same arguments;
    `called`: the name users type now, if not `new`."""
    if os.environ.get("RANK", "0") == "0":
        print(
            f"titan: python -m {old} is now python -m {called or new} (the old name keeps working)",
            file=sys.stderr,
            flush=True,
        )
    # as `python -m <new>` would: the main module is named after it, which the processes of
    # DCP's async saves re-import by that name
    runpy.run_module(new, run_name="__main__", alter_sys=True)
