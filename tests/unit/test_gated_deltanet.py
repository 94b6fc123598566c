"""Gated DeltaNet (titan.models.common.gated_deltanet): equal to transformers' Qwen3-Next
layer on the same weights; documents as if alone; decoding token by token from the carried
state equals the whole sequence."""

import pytest
import torch

from titan.models.common.gated_deltanet import GatedDeltaNet
from titan.models.common.init import seeded_init_all

DIM, KH, VH, KD, VD, KERNEL = 64, 2, 4, 16, 8, 4


@pytest.fixture(scope="module")
def mixer():
    torch.manual_seed(0)
    m = GatedDeltaNet(DIM, KH, VH, KD, VD, KERNEL, 1e-6, chunk=16)
    seeded_init_all(m, m.param_inits(lambda t, g: t.normal_(0, 0.02, generator=g)), 0)
    with torch.no_grad():  # a norm that is not all ones, so the test sees its order
        m.norm.weight.add_(torch.randn(VD) * 0.1)
    return m


def x_of(seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, seq, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.needs("transformers")
def test_equal_to_transformers_layer(mixer):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(
        hidden_size=DIM,
        linear_num_key_heads=KH,
        linear_num_value_heads=VH,
        linear_key_head_dim=KD,
        linear_value_head_dim=VD,
        linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    hf = Qwen3NextGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        hf.in_proj_qkvz.weight.copy_(mixer.in_qkvz.weight)
        hf.in_proj_ba.weight.copy_(mixer.in_ba.weight)
        hf.conv1d.weight.copy_(mixer.conv.unsqueeze(1))
        hf.dt_bias.copy_(mixer.dt_bias)
        hf.A_log.copy_(mixer.A_log)
        hf.norm.weight.copy_(mixer.norm.weight)
        hf.out_proj.weight.copy_(mixer.out.weight)
    x = x_of(150)
    with torch.no_grad():
        expected = hf(x)
        got, _ = mixer(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_each_document_computes_as_if_alone(mixer):
    """Documents starting at 1 (the convolution's window then spans two), 40 and 41 (a
    one-token document), and 70 of row 1."""
    x = x_of(100)
    resets = torch.zeros(2, 100, dtype=torch.bool)
    resets[0, [1, 40, 41]] = True
    resets[1, 70] = True
    with torch.no_grad():
        out, _ = mixer(x, resets=resets)
        for row, first, end in ((0, 0, 1), (0, 1, 40), (0, 40, 41), (0, 41, 100), (1, 70, 100)):
            alone, _ = mixer(x[row : row + 1, first:end])
            assert torch.allclose(out[row : row + 1, first:end], alone, rtol=1e-5, atol=1e-6)


def test_decoding_from_the_carried_state_equals_the_whole_sequence(mixer):
    """A prompt of 37 tokens at once, then 5 tokens one at a time (the recurrent form) from
    the state each step leaves."""
    x = x_of(42)
    with torch.no_grad():
        whole, _ = mixer(x)
        out, state = mixer(x[:, :37])
        steps = [out]
        for t in range(37, 42):
            y, state = mixer(x[:, t : t + 1], state=state)
            steps.append(y)
    assert torch.allclose(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-6)
