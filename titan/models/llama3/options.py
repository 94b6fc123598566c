"""Llama 3's own config section, [llama3]: RoPE, for the long-context phase of a run (Llama
3.1's frequency scaling: factor 8 over the 8192 positions it was trained at, for 128k). An
option set here overrides the flavor's value; unset, the flavor's holds. Resuming a checkpoint
with other RoPE settings needs --checkpoint.allow_rope_change. Torch-free: the config parser
loads it (titan.config.family_options)."""

from dataclasses import dataclass

from titan.config.entry import register
from titan.config.family_options import FamilySection
from titan.config.job_config import opt


@dataclass
class Options:
    rope_theta: float = opt(500000.0, "RoPE's base (unset: the flavor's, 500000)")
    rope_scaling_factor: float | None = opt(
        None,
        "Llama 3.1 scaling: slow RoPE's long wavelengths by this factor (8.0 for 128k); "
        "None: plain RoPE; unset: the flavor's",
    )
    rope_low_freq_factor: float = opt(
        1.0, "Llama 3.1 scaling: wavelengths past original_max_len / this are fully scaled"
    )
    rope_high_freq_factor: float = opt(
        4.0, "Llama 3.1 scaling: wavelengths under original_max_len / this are kept"
    )
    rope_original_max_len: int = opt(
        8192, "Llama 3.1 scaling: the context the model was trained at before the extension"
    )


register(FamilySection("llama3", options=Options))
