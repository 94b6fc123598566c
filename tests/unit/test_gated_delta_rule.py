"""The gated delta rule (titan.models.common.gated_delta_rule): the chunked form equals the
recurrent one, forward and backward; document starts empty the state (each document as if
alone); a state carried over continues a sequence; both equal transformers' reference forms."""

import pytest
import torch

from titan.models.common.gated_delta_rule import chunked, recurrent

# 2 key heads serving 4 value heads, 150 tokens: 2 chunks of 64 and a padded third
B, N, HK, HV, DK, DV = 2, 150, 2, 4, 16, 8


def inputs(dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = rand(B, N, HK, DK), rand(B, N, HK, DK), rand(B, N, HV, DV)
    # log decays <= 0 and write strengths in (0, 1), as the models' gates give them
    g = -torch.rand(B, N, HV, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(B, N, HV, generator=gen, dtype=dtype)
    out = [q, k, v, g, beta]
    for t in out:
        t.requires_grad_(requires_grad)
    return out


def starts(*pairs) -> torch.Tensor:
    resets = torch.zeros(B, N, dtype=torch.bool)
    for row, pos in pairs:
        resets[row, pos] = True
    return resets


# documents starting inside a chunk, at a chunk's first token, and a one-token document
RESETS = starts((0, 40), (0, 64), (1, 1), (1, 100), (1, 101))


@pytest.mark.parametrize("resets", [None, RESETS], ids=["one document", "documents"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_the_chunked_form_equals_the_recurrent_one(resets, chunk):
    """In float64 the two orders of summation agree to rounding (1e-12)."""
    x = inputs()
    o1, s1 = recurrent(*x, resets=resets)
    o2, s2 = chunked(*x, resets=resets, chunk=chunk)
    assert torch.allclose(o1, o2, rtol=0, atol=1e-12)
    assert torch.allclose(s1, s2, rtol=0, atol=1e-12)


def test_gradients_of_the_chunked_form_equal_the_recurrent_ones():
    x1, x2 = inputs(requires_grad=True), inputs(requires_grad=True)
    w = torch.randn(B, N, HV, DV, dtype=torch.float64)
    s0 = torch.randn(B, HV, DK, DV, dtype=torch.float64)
    for x, form in ((x1, recurrent), (x2, chunked)):
        out, state = form(*x, state=s0, resets=RESETS)
        ((out * w).sum() + state.square().sum()).backward()
    for a, b in zip(x1, x2):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", [recurrent, chunked])
def test_each_document_computes_as_if_alone(form):
    x = inputs()
    out, state = form(*x, resets=RESETS)
    for row, first, end in ((0, 40, 64), (0, 64, N), (1, 1, 100), (1, 100, 101), (1, 101, N)):
        alone, last = form(*(t[row : row + 1, first:end] for t in x))
        assert torch.allclose(out[row : row + 1, first:end], alone, rtol=0, atol=1e-12)
    assert torch.allclose(state[1:], last, rtol=0, atol=1e-12)  # the state: the last document's


@pytest.mark.parametrize("form", [recurrent, chunked])
def test_a_carried_state_continues_the_sequence(form):
    """Tokens 0-89 then 90-149 from the state the first part left equal the whole: what
    decoding token by token and a context-parallel rank's continuation rely on."""
    x = inputs()
    whole, end = form(*x)
    first, mid = form(*(t[:, :90] for t in x))
    second, end2 = form(*(t[:, 90:] for t in x), state=mid)
    assert torch.allclose(torch.cat([first, second], 1), whole, rtol=0, atol=1e-12)
    assert torch.allclose(end2, end, rtol=0, atol=1e-12)


def test_float32_inputs_compute_in_float32_and_return_their_dtype():
    x = [t.to(torch.bfloat16) for t in inputs(torch.float32)]
    out, state = chunked(*x)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_value_heads_must_group_the_key_heads():
    q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        recurrent(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


@pytest.mark.needs("transformers")
def test_equal_to_transformers_reference_forms():
    """transformers' PyTorch forms of Qwen3-Next (the fallback without flash-linear-attention),
    q and k normalized in the kernel as the models call them: equal in float32 (the same
    operations in the same order: 1e-6 leaves room for a library's reordering)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    x = inputs(torch.float32)
    s0 = torch.randn(B, HV, DK, DV)
    for theirs, ours in (
        (hf.torch_chunk_gated_delta_rule, chunked),
        (hf.torch_recurrent_gated_delta_rule, recurrent),
    ):
        out, state = theirs(
            *x, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        got, got_state = ours(*x, state=s0)
        assert torch.allclose(got, out, rtol=1e-6, atol=1e-6)
        assert torch.allclose(got_state, state, rtol=1e-6, atol=1e-6)
