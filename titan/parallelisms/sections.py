"""The parallelisms' own sections beside [parallelism]: activation checkpointing and
torch.compile, with their checks; torch-free (applied by activation_checkpoint.py and
compile.py)."""

from dataclasses import dataclass
from typing import Literal

from titan.config import extensions
from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = opt(
        "none", "Recompute activations in backward: none, full (every block) or selective"
    )
    selective_ac_option: str = opt(
        "2",
        "Selective AC: 'op' = save matmul/attention outputs per op; an integer N = "
        "checkpoint every N-th block",
    )


@dataclass
class Compile:
    enable: bool = opt(
        False, "torch.compile the model (per transformer block; whole model with TP on CPU)"
    )
    backend: str = opt("inductor", "torch.compile backend")


def check(job) -> None:
    from titan.config.manager import require

    option = job.activation_checkpoint.selective_ac_option
    require(
        job,
        option == "op" or (option.isdigit() and int(option) >= 1),
        "activation_checkpoint.selective_ac_option",
        "use 'op' (save matmul/attention outputs) or a positive integer N (checkpoint every "
        "N-th block)",
    )


def _ignored_ac(job) -> dict[str, str]:
    off = job.activation_checkpoint.mode == "none"
    why = "activation_checkpoint.mode is none"
    return extensions.ignored_when(job, "activation_checkpoint", off, why, "mode")


def _ignored_compile(job) -> dict[str, str]:
    off = not job.compile.enable
    return extensions.ignored_when(job, "compile", off, "compile.enable is false", "enable")


register(
    Entry(
        "activation_checkpoint",
        section="activation_checkpoint",
        options=ActivationCheckpoint,
        check=check,
        ignored=_ignored_ac,
    )
)
register(Entry("compile", section="compile", options=Compile, ignored=_ignored_compile))
