"""HF state-dict adapter: exact round trip, and q/k permutation against HF's rotate_half RoPE."""

import pytest
import torch

from titan.models.llama3.args import LLAMA3_FLAVORS
from titan.models.llama3.model import Transformer, apply_rope
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

ARGS = LLAMA3_FLAVORS["debugmodel"].with_updates(max_seq_len=32)


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        m = Transformer(ARGS)
    m.to_empty(device="cpu")
    m.init_weights(seed=3)
    return m


@pytest.fixture(scope="module")
def adapter():
    return Llama3StateDictAdapter(ARGS)


def test_round_trip_identical(model, adapter):
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    assert len(hf) == len(sd)
    assert "model.embed_tokens.weight" in hf and "lm_head.weight" in hf
    assert "model.layers.0.self_attn.q_proj.weight" in hf
    assert "model.layers.5.post_attention_layernorm.weight" in hf
    back = adapter.from_hf(hf)
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert back[name].shape == t.shape and torch.equal(back[name], t), name
    # q/k really are permuted on the way (else the test below would be vacuous), v is not
    hf0, sd0 = "model.layers.0.self_attn.", "layers.0.attention."
    assert not torch.equal(hf[hf0 + "q_proj.weight"], sd[sd0 + "wq.weight"])
    assert not torch.equal(hf[hf0 + "k_proj.weight"], sd[sd0 + "wk.weight"])
    assert torch.equal(hf[hf0 + "v_proj.weight"], sd[sd0 + "wv.weight"])
    # the loaded state dict is accepted by a fresh model
    with torch.device("meta"):
        fresh = Transformer(ARGS)
    fresh.load_state_dict(back, assign=True)


def test_from_hf_skips_rotary_and_rejects_unknown(adapter, model):
    hf = adapter.to_hf(model.state_dict())
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in adapter.from_hf(hf)
    with pytest.raises(KeyError):
        adapter.from_hf({"model.layers.0.mlp.something.weight": torch.zeros(1)})
    with pytest.raises(KeyError):
        adapter.to_hf({"layers.0.attention.wz.weight": torch.zeros(1)})


def test_hf_config(adapter):
    cfg = adapter.hf_config()
    assert cfg["hidden_size"] == ARGS.dim and cfg["num_key_value_heads"] == ARGS.n_kv_heads
    assert cfg["intermediate_size"] == ARGS.ffn_hidden_dim and cfg["head_dim"] == ARGS.head_dim
    assert "rope_scaling" not in cfg
    cfg8 = Llama3StateDictAdapter(LLAMA3_FLAVORS["8B"]).hf_config()
    assert cfg8["rope_scaling"]["factor"] == 8.0 and cfg8["rope_scaling"]["rope_type"] == "llama3"


# ----------------------------------------------------------------------------- HF reference


def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(x, positions, head_dim, theta):
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb; x: (batch, heads, seq, hd)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(positions.double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    return x * cos + hf_rotate_half(x) * sin


def hf_scores(x, wq, wk, n_heads, n_kv, head_dim, theta):
    bs, seq, _ = x.shape
    q = (x @ wq.T).view(bs, seq, n_heads, head_dim).transpose(1, 2)
    k = (x @ wk.T).view(bs, seq, n_kv, head_dim).transpose(1, 2)
    pos = torch.arange(seq)
    q, k = hf_rope(q, pos, head_dim, theta), hf_rope(k, pos, head_dim, theta)
    k = k.repeat_interleave(n_heads // n_kv, dim=1)  # HF repeat_kv
    return q @ k.transpose(-1, -2)


def titan_scores(x, wq, wk, model):
    bs, seq, _ = x.shape
    hd = ARGS.head_dim
    q = apply_rope((x @ wq.T).view(bs, seq, -1, hd), model.rope)
    k = apply_rope((x @ wk.T).view(bs, seq, -1, hd), model.rope)
    k = k.repeat_interleave(ARGS.n_heads // ARGS.n_kv_heads, dim=2)
    return q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)


def test_qk_permutation_matches_hf_rotate_half(model, adapter):
    layer = 2
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    x = torch.randn(2, 24, ARGS.dim, generator=torch.Generator().manual_seed(0))
    wq, wk = sd[f"layers.{layer}.attention.wq.weight"], sd[f"layers.{layer}.attention.wk.weight"]
    hq = hf[f"model.layers.{layer}.self_attn.q_proj.weight"]
    hk = hf[f"model.layers.{layer}.self_attn.k_proj.weight"]
    ours = titan_scores(x, wq, wk, model)
    theirs = hf_scores(x, hq, hk, ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim, ARGS.rope_theta)
    assert ours.shape == theirs.shape == (2, ARGS.n_heads, 24, 24)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    # control: HF's RoPE on the unpermuted titan weights gives different scores
    wrong = hf_scores(x, wq, wk, ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim, ARGS.rope_theta)
    assert not torch.allclose(ours, wrong, rtol=1e-2, atol=1e-3)


def test_rotated_q_is_the_permuted_rotated_q(model, adapter):
    """Stronger than scores: each HF half-layout feature is a titan interleaved feature."""
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    x = torch.randn(1, 10, ARGS.dim, generator=torch.Generator().manual_seed(1))
    hd, nh = ARGS.head_dim, ARGS.n_heads
    q_titan = apply_rope((x @ sd["layers.0.attention.wq.weight"].T).view(1, 10, nh, hd), model.rope)
    q_hf = hf_rope(
        (x @ hf["model.layers.0.self_attn.q_proj.weight"].T).view(1, 10, nh, hd).transpose(1, 2),
        torch.arange(10),
        hd,
        ARGS.rope_theta,
    ).transpose(1, 2)
    # HF feature j < hd/2 is titan's 2j; feature hd/2 + j is titan's 2j + 1
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    torch.testing.assert_close(q_hf, q_titan[..., perm], rtol=1e-4, atol=1e-5)
