"""RoPE: rotation properties, the Llama 3.1 frequency scaling, and the cache layout."""

import math

import pytest
import torch

from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import apply_rope, rope_cache, rope_frequencies

ARGS = Llama3Args(dim=512, n_heads=8, n_kv_heads=8, max_seq_len=64)  # head_dim 64


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_rope_cache_shape_and_values():
    cache = rope_cache(ARGS)
    assert cache.shape == (ARGS.max_seq_len, ARGS.head_dim // 2, 2)
    assert cache.dtype == torch.float32
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    pos = 37
    torch.testing.assert_close(cache[pos, :, 0], torch.cos(pos * freqs).float())
    torch.testing.assert_close(cache[pos, :, 1], torch.sin(pos * freqs).float())
    assert torch.equal(cache[0, :, 0], torch.ones(32))
    assert torch.equal(cache[0, :, 1], torch.zeros(32))


def test_rope_cache_8b_shape():
    args = LLAMA3_FLAVORS["8B"].with_updates(max_seq_len=128)
    assert rope_cache(args).shape == (128, 64, 2)


def test_apply_rope_preserves_pair_norms():
    x = randn(2, ARGS.max_seq_len, 4, ARGS.head_dim)
    y = apply_rope(x, rope_cache(ARGS))
    assert y.shape == x.shape and y.dtype == x.dtype
    nx = x.unflatten(-1, (-1, 2)).norm(dim=-1)
    ny = y.unflatten(-1, (-1, 2)).norm(dim=-1)
    torch.testing.assert_close(ny, nx, rtol=1e-5, atol=1e-5)
    # position 0 is the identity; later positions really rotate
    torch.testing.assert_close(y[:, 0], x[:, 0])
    assert not torch.allclose(y[:, 1:], x[:, 1:], atol=1e-3)


def test_apply_rope_interleaved_pair_rotation():
    """Pair i of position p is rotated by angle p * freq_i, as a 2-D rotation."""
    x = randn(1, 8, 1, ARGS.head_dim, seed=1)
    y = apply_rope(x, rope_cache(ARGS))
    freqs = rope_frequencies(ARGS)
    p, i = 5, 3
    a = p * freqs[i].item()
    x0, x1 = x[0, p, 0, 2 * i].item(), x[0, p, 0, 2 * i + 1].item()
    assert y[0, p, 0, 2 * i].item() == pytest.approx(x0 * math.cos(a) - x1 * math.sin(a), abs=1e-5)
    y1 = x0 * math.sin(a) + x1 * math.cos(a)
    assert y[0, p, 0, 2 * i + 1].item() == pytest.approx(y1, abs=1e-5)


def test_apply_rope_relative_position():
    """<R_m q, R_n k> depends only on m - n."""
    seq = ARGS.max_seq_len
    q, k = randn(ARGS.head_dim, seed=2), randn(ARGS.head_dim, seed=3)
    rope = rope_cache(ARGS)
    rq = apply_rope(q.expand(1, seq, 1, -1).contiguous(), rope)[0, :, 0]
    rk = apply_rope(k.expand(1, seq, 1, -1).contiguous(), rope)[0, :, 0]
    scores = rq @ rk.T  # scores[m, n]
    for offset in (0, 1, 7, 30, -5, -20):
        diag = torch.diagonal(scores, offset=-offset)  # entries with m - n == offset
        assert diag.numel() > 10
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=1e-4, atol=1e-4)
    # and it does depend on the offset
    assert abs(scores[10, 0] - scores[10, 9]) > 1e-3


def test_llama31_scaling():
    plain = Llama3Args(dim=4096, n_heads=32, rope_scaling_factor=None)
    scaled = plain.with_updates(
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
    )
    f0, f1 = rope_frequencies(plain), rope_frequencies(scaled)
    assert f0.shape == f1.shape == (64,)
    wavelen = 2 * math.pi / f0
    high = wavelen < 8192 / 4.0  # short wavelengths: kept
    low = wavelen > 8192 / 1.0  # long wavelengths: slowed by the factor
    mid = ~high & ~low
    assert high.sum() > 10 and low.sum() > 10 and mid.sum() > 0
    assert high[0] and low[-1]  # the first pairs are the fastest
    torch.testing.assert_close(f1[high], f0[high], rtol=0, atol=0)
    torch.testing.assert_close(f1[low], f0[low] / 8, rtol=1e-12, atol=0)
    assert ((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8)).all()
    # reference: Meta's apply_scaling, written out per frequency
    for j in torch.nonzero(mid).flatten().tolist():
        freq = f0[j].item()
        smooth = (8192 / (2 * math.pi / freq) - 1.0) / (4.0 - 1.0)
        assert f1[j].item() == pytest.approx((1 - smooth) * freq / 8 + smooth * freq, rel=1e-12)


def test_flavors_use_their_scaling():
    assert LLAMA3_FLAVORS["8B"].rope_scaling_factor == 8.0
    assert LLAMA3_FLAVORS["405B"].rope_scaling_factor == 8.0
    assert LLAMA3_FLAVORS["1B"].rope_scaling_factor == 32.0
    assert LLAMA3_FLAVORS["debugmodel"].rope_scaling_factor is None
    f = rope_frequencies(LLAMA3_FLAVORS["1B"])
    f0 = rope_frequencies(LLAMA3_FLAVORS["1B"].with_updates(rope_scaling_factor=None))
    assert f[-1].item() == pytest.approx(f0[-1].item() / 32, rel=1e-12)
