"""Muon in the optimizer registry: its [muon] section, checks and state bytes (torch-free; the
optimizer is titan.components.optim.muon)."""

import re
from dataclasses import dataclass
from typing import Literal

from titan.components.optim.adam_spec import adam_state_bytes, check_adam
from titan.components.optim.registry import OptimizerSpec
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class MuonOptions:
    momentum: float = opt(0.95, "Muon: momentum of the gradient before orthogonalization")
    nesterov: bool = opt(True, "Muon: orthogonalize the Nesterov look-ahead of the momentum")
    ns_steps: int = opt(5, "Muon: Newton-Schulz iterations per step")
    ns_dtype: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "Muon: dtype of the Newton-Schulz iteration (bfloat16 as in the reference)"
    )
    adjust_lr: Literal["match_rms_adamw", "original"] = opt(
        "match_rms_adamw",
        "Muon: scale of a matrix's update: 0.2 x sqrt(max(rows, cols)), "
        "AdamW's RMS (Moonlight; one lr for both), or sqrt(max(1, rows/cols)) (Keller Jordan)",
    )
    adamw_params: str = opt(
        r"^(tok_embeddings|output)\.",
        "Muon: regex of parameter names trained by AdamW though "
        "they are matrices (embeddings, output head); vectors (norms, biases) always are",
    )


def muon_state_bytes(name, shape, elements, cfg, options) -> int:
    """A matrix: one momentum buffer (float32); the rest: AdamW's moments and step."""
    if len(shape) >= 2 and not re.search(options.adamw_params, name):
        return 4 * elements
    return adam_state_bytes(name, shape, elements, cfg, options)


def check_muon(job) -> None:
    from titan.config.manager import require

    check_adam(job)  # its AdamW half takes optimizer.beta1, beta2, eps
    m = job.muon
    require(job, 0 <= m.momentum < 1, "muon.momentum", "must lie in [0, 1)")
    require(job, m.ns_steps >= 1, "muon.ns_steps", "must be >= 1")
    try:
        re.compile(m.adamw_params)
    except re.error as e:
        require(job, False, "muon.adamw_params", f"is not a regex ({e})")
    require(
        job,
        job.optimizer.state_dtype == "float32",
        "optimizer.state_dtype",
        "bfloat16 moments are AdamW's and Adam's option; Muon keeps float32 state",
    )


register(
    OptimizerSpec(
        "Muon",
        build="titan.components.optim.muon:build",
        state_bytes=muon_state_bytes,
        check=check_muon,
        section="muon",
        options=MuonOptions,
    )
)
