"""Block-causal attention over packed documents: masks, positions, and the loss of a packed
window against its documents run one by one."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from titan.models.common.documents import (
    block_causal_block_mask,
    block_causal_mask,
    document_ids,
    document_positions,
)
from titan.models.llama3 import LLAMA3_FLAVORS, Transformer

BOS = 0


def test_ids_and_positions():
    tokens = torch.tensor([[5, 6, BOS, 7, 8, 9, BOS, 4], [BOS, 1, 2, 3, BOS, BOS, 5, 6]])
    ids = document_ids(tokens, BOS)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 3, 3, 3]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 0, 1, 2]]
    mask = block_causal_mask(ids)[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False, False, False, False]
    assert mask.sum().item() == 3 + 10 + 3  # 2 + 4 + 2 tokens: lower triangles only


def _model(seed=0):
    args = LLAMA3_FLAVORS["debugmodel"].with_updates(vocab_size=64, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def _packed_batch(seed=1):
    """Two windows of 32 tokens, each several documents (the first begun before the window)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 64, (2, 33), generator=g)
    for b, starts in enumerate([[5, 12, 20], [1, 9, 10, 30]]):
        tokens[b, starts] = BOS
    return tokens[:, :-1], tokens[:, 1:]


def test_packed_loss_equals_documents_one_by_one():
    torch.manual_seed(0)
    model = _model()
    inputs, labels = _packed_batch()
    ids = document_ids(inputs, BOS)
    logits = model(inputs, doc_ids=ids, positions=document_positions(ids))
    packed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    alone, tokens = torch.zeros((), dtype=torch.float64), 0
    for b in range(inputs.shape[0]):
        for d in ids[b].unique():
            span = (ids[b] == d).nonzero().flatten()
            x, y = inputs[b, span][None], labels[b, span][None]
            alone += F.cross_entropy(model(x)[0], y[0], reduction="sum").double()
            tokens += len(span)
    assert tokens == labels.numel()
    torch.testing.assert_close(packed.double() / tokens, alone / tokens, rtol=1e-5, atol=0)
    # a plain causal window mixes documents: the check above can fail
    causal = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
    assert abs(causal.item() - packed.item()) / packed.item() > 1e-4  # 5e-4 measured


def test_block_causal_gradients_stay_within_documents():
    model = _model()
    inputs, _ = _packed_batch()
    ids = document_ids(inputs, BOS)
    h = model.tok_embeddings(inputs).detach().requires_grad_()
    model.tok_embeddings, model.output = None, None  # feed embeddings, read hidden states
    out = model(h, doc_ids=ids)
    out[0, 8].sum().backward()  # a token of the document that starts at 5
    touched = h.grad[0].abs().sum(-1) > 0
    assert touched.nonzero().flatten().tolist() == [5, 6, 7, 8]


def test_flex_block_mask_matches_sdpa_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = _model()
    inputs, _ = _packed_batch()
    ids = document_ids(inputs, BOS)
    rope = model.rope[document_positions(ids)]
    with torch.no_grad():
        h = model.tok_embeddings(inputs)
        layer = model.layers["0"]
        with warnings.catch_warnings():
            # eager FlexAttention on CPU says it is unfused, once per process
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            flex = layer(h, rope, mask=block_causal_block_mask(ids))
        sdpa = layer(h, rope, mask=block_causal_mask(ids))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
