"""Peak FLOP/s of a device, for MFU: a GPU's datasheet figure, or none on CPU."""

import time

import torch

# dense bf16 tensor-core peaks from vendor datasheets (no sparsity)
_GPU_PEAK_BF16 = [
    ("H200", 989e12),
    ("H200 NVL", 836e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("GB200", 2500e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 125e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 383e12),
]


def gpu_peak_flops(device_name: str) -> float | None:
    # the longest key found in the name wins: "NVIDIA GB200" holds "B200" too
    matches = [(len(key), peak) for key, peak in _GPU_PEAK_BF16 if key in device_name]
    return max(matches)[1] if matches else None


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, n: int = 1024, iters: int = 4, repeats: int = 3
) -> float:
    """Best achieved FLOP/s of a square matmul: the ceiling on CPUs, which publish no peak."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm the kernels
    best = 0.0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0))
    return best


# A CPU publishes no peak, and a matmul timed at start-up is no ceiling either: on a shared
# or throttled machine it ran slower than the steps that followed (the quick start showed
# 200-300% MFU). torchtitan reports no meaningful CPU MFU either; a stated figure is used.
NO_CPU_PEAK = (
    "not reported on CPU (no datasheet peak; a timed matmul is no ceiling): set "
    "metrics.peak_flops to the FLOP/s to compare with"
)


def peak_flops(
    device: torch.device, dtype: torch.dtype, override: float = 0.0
) -> tuple[float | None, str]:
    """(peak FLOP/s or None when MFU is not reported, where the figure came from)."""
    if override > 0:
        return override, "metrics.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return peak, f"datasheet bf16 peak of {name}"
        return measure_matmul_flops(device, torch.bfloat16, n=4096), f"measured matmul on {name}"
    return None, NO_CPU_PEAK
