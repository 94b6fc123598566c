"""The NCCL flight recorder, from the comm section: each rank keeps its last
`trace_buf_size` collectives (sequence number, op, sizes, state, stack) and, when a collective
times out, dumps them to `<dump_folder>/<save_traces_folder>/rank_<R>`; comparing the ranks'
dumps (`python -m torch.distributed.flight_recorder.fr_trace <folder>`) names the rank that
stopped calling which collective.

It is read by the process groups from the environment when they are made, so this runs
before `init_process_group`. A variable the user exported wins. gloo records its collectives
too (titan's per-rank step times read them: rank_times.py) but dumps nothing on a timeout:
on CPU these settings are accepted and not applied.
"""

import os
from pathlib import Path

# the recorder's buffer size: torch's current name, which its flight recorder reads first, and
# the older one, which NCCL's process group still reads to dump on a timeout (torch warns that
# it is deprecated: set only for the opt-in CUDA recorder)
BUFFER_VAR, NCCL_BUFFER_VAR = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"


def flight_recorder_env(cfg, dump_folder: str) -> dict[str, str]:
    """The variables for `cfg` (the comm section); none when trace_buf_size is 0."""
    if cfg.trace_buf_size <= 0:
        return {}
    prefix = str(Path(dump_folder).resolve() / cfg.save_traces_folder / "rank_")
    size = str(cfg.trace_buf_size)
    # the dump file's prefix under its current and its older name, as for the buffer
    return {
        BUFFER_VAR: size,
        NCCL_BUFFER_VAR: size,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


# collectives the recorder keeps at least for per-rank step times: one step's, with room
STEP_BUFFER = 2000


def configure_flight_recorder(
    cfg, dump_folder: str, device_type: str, keep_step: bool = False
) -> None:
    """`cfg`: the comm section; `keep_step`: the run reads its collectives' stamps for
    each rank's step time (rank_times.py), whose recorder then keeps one step's at least
    (comm.trace_buf_size may set a larger buffer)."""
    env = flight_recorder_env(cfg, dump_folder) if device_type == "cuda" else {}
    if env:
        (Path(dump_folder) / cfg.save_traces_folder).mkdir(parents=True, exist_ok=True)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    # the current name only: the older one makes torch warn that it is deprecated
    if keep_step and int(os.environ.get(BUFFER_VAR) or 0) < STEP_BUFFER:
        os.environ[BUFFER_VAR] = str(STEP_BUFFER)
