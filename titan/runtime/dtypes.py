"""The one map from dtype names (as configs and CLIs spell them) to torch dtypes."""

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# the codes of safetensors files' headers
_SAFETENSORS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_dtype(code: str) -> torch.dtype:
    """The dtype of a safetensors header's code ("BF16", "F32", ...)."""
    try:
        return _SAFETENSORS[code]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {code!r}") from None
