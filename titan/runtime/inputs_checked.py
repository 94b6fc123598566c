"""Whether this process makes the checks of what a run reads and holds (its data files'
heads, its checkpoint folders, its memory plan): once per launch. The launcher makes them and
tells its workers so (INPUTS_CHECKED in their environment); a run started without it makes
them on rank 0 only: on a thousand ranks, each reading the heads of every file would be a
load on shared storage, and a refusal on rank 0 stops the others (torchrun ends a job whose
rank exits)."""

import os

INPUTS_CHECKED = "TITAN_INPUTS_CHECKED"


def checks_inputs() -> bool:
    return os.environ.get(INPUTS_CHECKED) != "1" and int(os.environ.get("RANK", "0")) == 0
