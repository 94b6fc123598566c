"""The NCCL flight recorder, from the comm section: each rank keeps its last
`trace_buf_size` collectives (sequence number, op, sizes, state, stack) and, when a collective
times out, dumps them to `<dump_folder>/<save_traces_folder>/rank_<R>`; comparing the ranks'
dumps (`python -m torch.distributed.flight_recorder.fr_trace <folder>`) names the rank that
stopped calling which collective.

It is read by ProcessGroupNCCL from the environment when the process group is made, so this
runs before `init_process_group`. A variable the user exported wins. gloo keeps no such
record: on CPU the settings are accepted and do nothing.
"""

import os
from pathlib import Path


def flight_recorder_env(cfg, dump_folder: str) -> dict[str, str]:
    """The variables for `cfg` (the comm section); none when trace_buf_size is 0."""
    if cfg.trace_buf_size <= 0:
        return {}
    prefix = str(Path(dump_folder).resolve() / cfg.save_traces_folder / "rank_")
    size = str(cfg.trace_buf_size)
    # torch's current names and the older TORCH_NCCL_ ones (torch 2.11 on the GPU machine
    # reads both)
    return {"TORCH_FR_BUFFER_SIZE": size, "TORCH_NCCL_TRACE_BUFFER_SIZE": size,
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def configure_flight_recorder(cfg, dump_folder: str, device_type: str) -> None:
    env = flight_recorder_env(cfg, dump_folder) if device_type == "cuda" else {}
    if env:
        (Path(dump_folder) / cfg.save_traces_folder).mkdir(parents=True, exist_ok=True)
    for key, value in env.items():
        os.environ.setdefault(key, value)
