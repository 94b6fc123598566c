"""Rotary position embeddings: the frequencies (plain, Llama 3.1's long-context scaling, YaRN
as DeepSeek-V3 and Qwen3 use it), the (cos, sin) table a model keeps as a buffer, and the
rotation in either layout: interleaved pairs (Meta's Llama) or two halves (HF's rotate_half,
Qwen3's native layout)."""

import math

import torch


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """The plain per-pair rotation frequencies, float64 (head_dim / 2 of them)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def llama3_scaled(
    freqs: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_len: int,
) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between
    blended."""
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, blended)
    return torch.where(wavelen < high_wavelen, freqs, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaled(
    head_dim: int,
    theta: float,
    factor: float,
    original_max_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times are kept, with a linear ramp between, its ends rounded outwards to whole
    dimensions unless `truncate` is off (GPT-OSS's, HF rope_parameters.truncate). Computed in
    float32, as the published checkpoints' reference implementations do."""

    def correction_dim(rotations: float) -> float:
        return (
            head_dim
            * math.log(original_max_len / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (1.0 / (factor * powers) * ramp + 1.0 / powers * (1 - ramp)).double()


def rope_table(freqs: torch.Tensor, max_len: int, scale: float = 1.0, device=None) -> torch.Tensor:
    """(max_len, head_dim/2, 2) of (cos, sin) per position and pair, times `scale` (YaRN's
    attention factor); real-valued, for compile and DTensor."""
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freqs)
    return (torch.stack([angles.cos(), angles.sin()], dim=-1) * scale).float().to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate x: (batch, seq, heads, head_dim) by its positions' angles.

    `rope` is the table (max_len, head_dim/2, 2), whose first rows are x's positions, or the
    rows of each sequence's positions, (batch, seq, head_dim/2, 2). Pair i is
    (x[2i], x[2i+1]) when `interleaved`, else (x[i], x[i + head_dim/2])."""
    if rope.dim() == 3:
        rope = rope[: x.shape[1]]
    xf = x.float()
    if interleaved and not torch.compiler.is_compiling():
        # the same arithmetic as the real form below, (x0 cos - x1 sin, x0 sin + x1 cos), as
        # one complex multiply forward and one backward, where the real form is a dozen
        # kernels in eager. Compiled code takes the real form: inductor fuses it, and
        # generates no complex code
        turn = torch.view_as_complex(rope.float())[..., None, :]
        return (
            torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * turn)
            .flatten(-2)
            .type_as(x)
        )
    cos = rope[..., None, :, 0]
    sin = rope[..., None, :, 1]
    if interleaved:
        pairs = xf.unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return (
            torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)
        )
    # the same sums as (x0 cos - x1 sin, x1 cos + x0 sin), bit for bit, as HF's rotate_half
    # writes them: two full-width multiplies instead of four on strided halves (half the
    # time forward and backward in eager)
    x0, x1 = xf.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return (xf * cos + torch.cat([-x1, x0], dim=-1) * sin).type_as(x)


def yarn_rope_table(
    head_dim: int,
    theta: float,
    max_len: int,
    factor: float | None,
    original_max_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    device=None,
) -> torch.Tensor:
    """The rope_table of plain RoPE (`factor` None) or of YaRN stretched by `factor`, scaled by
    YaRN's attention temperature (Qwen3's and GPT-OSS's; DeepSeek-V3 scales by a ratio)."""
    if factor is None:
        return rope_table(inverse_frequencies(head_dim, theta), max_len, device=device)
    freqs = yarn_scaled(head_dim, theta, factor, original_max_len, beta_fast, beta_slow, truncate)
    return rope_table(freqs, max_len, scale=yarn_mscale(factor), device=device)
