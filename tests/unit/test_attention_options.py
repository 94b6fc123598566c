"""The attention options a family sets per layer (biases, a sliding window, learned sinks) as
their definitions say, on every path: SDPA's with a bool mask, FlexAttention's BlockMask with
the sinks joined through its log-sum-exp, and token-by-token decoding with the cache."""

import warnings

import pytest
import torch

from titan.models.common.attention import Attention
from titan.models.common.decode import DecodeCache
from titan.models.common.documents import block_causal_block_mask, block_causal_mask
from titan.models.common.init import normal, seeded_init_all
from titan.models.common.rope import apply_rope, inverse_frequencies, rope_table

DIM, HEADS, KV_HEADS, HEAD_DIM, SEQ = 32, 4, 2, 8, 12
ROPE = rope_table(inverse_frequencies(HEAD_DIM, 10000.0), 64)


def attention(window=None, sinks=True, bias=True, seed=0) -> Attention:
    a = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, bias=bias, sliding_window=window, sinks=sinks)
    seeded_init_all(a, a.param_inits(normal(0.02)), seed)
    with torch.no_grad():  # biases and sinks start at zero: make them matter
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in a.named_parameters():
            if n.endswith("bias") or n == "sinks":
                p.copy_(torch.randn(p.shape, generator=g))
    return a


def reference(a: Attention, x: torch.Tensor, doc_ids=None) -> torch.Tensor:
    """From the definition, one query at a time: the keys it may see (earlier, same
    document, within the window), softmax of their scores and its head's sink logit."""
    bs, seq, _ = x.shape
    q = apply_rope(a.wq(x).view(bs, seq, HEADS, HEAD_DIM), ROPE[:seq])
    k = apply_rope(a.wk(x).view(bs, seq, KV_HEADS, HEAD_DIM), ROPE[:seq])
    v = a.wv(x).view(bs, seq, KV_HEADS, HEAD_DIM)
    out = torch.zeros(bs, seq, HEADS, HEAD_DIM)
    for b in range(bs):
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            for i in range(seq):
                seen = [
                    j
                    for j in range(i + 1)
                    if (a.sliding_window is None or i - j < a.sliding_window)
                    and (doc_ids is None or doc_ids[b, i] == doc_ids[b, j])
                ]
                scores = torch.stack([q[b, i, h] @ k[b, j, kv] for j in seen]) / HEAD_DIM**0.5
                if a.sinks is not None:
                    scores = torch.cat([scores, a.sinks[h : h + 1]])
                p = scores.softmax(0)[: len(seen)]
                out[b, i, h] = sum(pj * v[b, j, kv] for pj, j in zip(p, seen, strict=True))
    return a.wo(out.reshape(bs, seq, -1))


X = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(7))
DOCS = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])


@pytest.mark.parametrize(
    "window,sinks,docs",
    [(4, True, False), (4, False, False), (None, True, False), (3, True, True), (None, True, True)],
    ids=["window_sinks", "window", "sinks", "window_sinks_docs", "sinks_docs"],
)
def test_sdpa_path_is_the_definition(window, sinks, docs):
    a = attention(window, sinks)
    mask = block_causal_mask(DOCS) if docs else None
    with torch.no_grad():
        got = a(X, ROPE[:SEQ], mask=mask)
        want = reference(a, X, DOCS if docs else None)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("window", [None, 3])
def test_flex_path_joins_the_sinks_through_its_log_sum_exp(window):
    a = attention(window)
    with torch.no_grad():
        with warnings.catch_warnings():
            # eager FlexAttention on CPU says it is unfused, once per process
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            got = a(X, ROPE[:SEQ], mask=block_causal_block_mask(DOCS, window))
        want = reference(a, X, DOCS)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_decoding_token_by_token_sees_the_same_window_and_sinks():
    a = attention(window=4)
    with torch.no_grad():
        full = a(X, ROPE[:SEQ])
        cache = DecodeCache(max_len=SEQ, pad=torch.zeros(2, dtype=torch.long))
        steps = []
        for t in range(SEQ):
            steps.append(a(X[:, t : t + 1], ROPE, cache=cache))
            cache.length += 1
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_defaults_keep_the_plain_projections():
    a = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM)
    assert a.sinks is None and a.sliding_window is None
    assert all(p.bias is None for p in (a.wq, a.wk, a.wv, a.wo))
    assert set(a.param_inits(normal(0.02))) == {f"{w}.weight" for w in ("wq", "wk", "wv", "wo")}
