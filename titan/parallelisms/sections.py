"""The parallelisms' own sections beside [parallelism]: activation checkpointing and
torch.compile, with their checks; torch-free (applied by activation_checkpoint.py and
compile.py)."""

from dataclasses import dataclass
from typing import Literal

from titan.config import extensions
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


extensions.register_section("activation_checkpoint", ActivationCheckpoint)
extensions.register_section("compile", Compile)
extensions.register_check(check)


def _ignored(job) -> dict[str, str]:
    ac, compiled = job.activation_checkpoint, job.compile
    return {
        **extensions.ignored_when(
            job,
            "activation_checkpoint",
            ac.mode == "none",
            "activation_checkpoint.mode is none",
            "mode",
        ),
        **extensions.ignored_when(
            job, "compile", not compiled.enable, "compile.enable is false", "enable"
        ),
    }


extensions.register_ignored(_ignored)
