"""float8's converter entry (`model.converters = ["float8"]`) and its [float8] section; torch-free
(the converter itself is titan.components.quantization.float8)."""

from dataclasses import dataclass
from typing import Literal

from titan.components.converters import ConverterSpec
from titan.config.entry import register
from titan.config.job_config import opt


@dataclass
class Float8:
    recipe_name: Literal["tensorwise", "rowwise"] = opt(
        "tensorwise", "Scaling: one scale per tensor, or per row (more accurate, slower)"
    )
    filter_fqns: list[str] = opt(
        ["output"], "Linear layers left in high precision: names containing any of these"
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "FSDP all-gathers the float8 weights (half the bytes); tensorwise only"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute every weight's scale in one pass after the optimizer step"
    )
    emulate: bool = opt(
        False, "Emulate float8 matmuls in float32 (CPU, tests); real float8 needs an SM 8.9+ GPU"
    )


def check(job) -> None:
    from titan.config.manager import require

    f8 = job.float8
    require(
        job,
        f8.recipe_name == "tensorwise" or not f8.enable_fsdp_float8_all_gather,
        "float8.enable_fsdp_float8_all_gather",
        "float8 all-gather needs recipe_name = "
        "'tensorwise' (torchao has it for tensorwise scales only)",
    )
    require(
        job,
        f8.enable_fsdp_float8_all_gather or not f8.precompute_float8_dynamic_scale_for_fsdp,
        "float8.precompute_float8_dynamic_scale_for_fsdp",
        "precomputes the scales of float8 all-gathers: needs enable_fsdp_float8_all_gather",
    )


def plan_check(job, plan) -> None:
    """torchao installed, and a device that has float8 matmuls (or emulation)."""
    from titan.config import ConfigError
    from titan.config.manager import require

    device = plan.device

    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        from titan.components.quantization.float8 import MISSING

        raise ConfigError(f"model.converters = {job.model.converters}: {MISSING}") from None
    f8 = job.float8
    require(
        job,
        f8.emulate or device == "cuda",
        "float8.emulate",
        "float8 matmuls need a GPU (SM 8.9+: H100, L4, RTX 4090); on CPU set float8.emulate = true",
    )
    if device == "cuda" and not f8.emulate:
        import torch

        major, minor = torch.cuda.get_device_capability()
        require(
            job,
            (major, minor) >= (8, 9),
            "float8.emulate",
            f"this GPU is SM {major}.{minor}; float8 matmuls need SM 8.9+ (or emulate)",
        )


register(
    ConverterSpec(
        "float8",
        build="titan.components.quantization.float8:Float8Converter",
        check=check,
        plan_check=plan_check,
        section="float8",
        options=Float8,
        order=10,
    )
)
