"""Llama 3 model: published sizes, meta-device build, init determinism and layout independence."""

import contextlib

import pytest
import torch

from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Transformer

DEBUG = LLAMA3_FLAVORS["debugmodel"]


def build(args: Llama3Args, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.fixture(scope="module")
def debug_model():
    return build(DEBUG, seed=0).eval()


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "flavor,expected,rel",
    [
        ("8B", 8.03e9, 0.005),
        ("70B", 70.6e9, 0.005),
        ("405B", 405.8e9, 0.005),
        # Llama 3.2 1B and 3B tie the embedding to the output: counted once
        ("1B", 1.236e9, 0.005),
        ("3B", 3.213e9, 0.005),
    ],
)
def test_num_params_published(flavor, expected, rel):
    assert LLAMA3_FLAVORS[flavor].num_params() == pytest.approx(expected, rel=rel)


def test_num_params_without_embedding():
    a = LLAMA3_FLAVORS["8B"]
    assert a.num_params() - a.num_params(include_embedding=False) == 128256 * 4096


@pytest.mark.parametrize(
    "flavor,hidden",
    [
        ("1B", 8192),
        ("8B", 14336),
        ("70B", 28672),
        ("405B", 53248),
    ],
)
def test_ffn_hidden_dim(flavor, hidden):
    assert LLAMA3_FLAVORS[flavor].ffn_hidden_dim == hidden


@pytest.mark.parametrize(
    "flavor,dims",
    [
        ("8B", (4096, 32, 32, 8, 128)),
        ("70B", (8192, 80, 64, 8, 128)),
        ("405B", (16384, 126, 128, 8, 128)),
        ("1B", (2048, 16, 32, 8, 64)),
    ],
)
def test_flavor_shapes(flavor, dims):
    a = LLAMA3_FLAVORS[flavor]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim) == dims
    assert a.vocab_size == 128256 and a.rope_theta == 500000.0


def test_8b_on_meta_matches_num_params():
    args = LLAMA3_FLAVORS["8B"]
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert model.layers["0"].feed_forward.w1.weight.shape == (14336, 4096)
    assert model.layers["0"].attention.wk.weight.shape == (8 * 128, 4096)


def test_debugmodel_numel_matches_num_params(debug_model):
    assert sum(p.numel() for p in debug_model.parameters()) == DEBUG.num_params()


# ----------------------------------------------------------------------------- forward


def test_debug_forward_shapes(debug_model):
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = debug_model(tokens)
    assert logits.shape == (2, 32, DEBUG.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # the rope buffer was recomputed by init_weights (to_empty left it uninitialized)
    assert debug_model.rope.shape == (DEBUG.max_seq_len, DEBUG.head_dim // 2, 2)
    cos_sin_at_0 = torch.tensor([[1.0, 0.0]]).expand(DEBUG.head_dim // 2, 2)
    assert torch.equal(debug_model.rope[0], cos_sin_at_0)


def test_initial_loss_near_uniform(debug_model):
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = debug_model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    # output std dim**-0.5 gives unit-scale logits: about log(V) + 1/2 at init
    assert abs(loss.item() - torch.log(torch.tensor(float(DEBUG.vocab_size))).item()) < 1.0


def test_causal(debug_model):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, DEBUG.vocab_size, (1, 24), generator=g)
    changed = tokens.clone()
    t = 15
    changed[0, t] = (tokens[0, t] + 1) % DEBUG.vocab_size
    with torch.no_grad():
        a, b = debug_model(tokens), debug_model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position moves


# ----------------------------------------------------------------------------- init


def test_init_same_seed_identical():
    a, b = build(DEBUG, seed=7), build(DEBUG, seed=7)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb), na


def test_init_different_seed_differs(debug_model):
    other = build(DEBUG, seed=1)
    for (name, p), (_, q) in zip(debug_model.named_parameters(), other.named_parameters()):
        if name.endswith("norm.weight"):
            assert torch.equal(p, q) and bool((p == 1).all())  # norms start at 1 whatever the seed
        else:
            assert not torch.equal(p, q), name


def test_init_params_are_distinct_and_scaled(debug_model):
    params = dict(debug_model.named_parameters())
    # same shape, same std, different names -> different values
    assert not torch.equal(
        params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"]
    )
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    deep = params[f"layers.{DEBUG.n_layers - 1}.attention.wo.weight"].std().item()
    assert deep == pytest.approx(0.02 / (2 * DEBUG.n_layers) ** 0.5 * 0.987, rel=0.1)  # truncated


def test_init_layout_independent(debug_model):
    full = dict(debug_model.named_parameters())
    # a middle pipeline stage: some layers, no embedding, no final norm/output
    with torch.device("meta"):
        stage = Transformer(DEBUG)
    for layer_id in ("0", "1", "5"):
        del stage.layers[layer_id]
    stage.tok_embeddings = None
    stage.norm = None
    stage.output = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=0)
    names = [n for n, _ in stage.named_parameters()]
    assert names and all(n.startswith(("layers.2.", "layers.3.", "layers.4.")) for n in names)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    # and the stage still runs on hidden states
    h = torch.randn(1, 8, DEBUG.dim)
    with torch.no_grad():
        assert stage(h).shape == (1, 8, DEBUG.dim)


def test_init_last_stage_layout_independent(debug_model):
    full = dict(debug_model.named_parameters())
    with torch.device("meta"):
        stage = Transformer(DEBUG)
    for layer_id in ("0", "1", "2"):
        del stage.layers[layer_id]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=0)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    # pipeline stages chained reproduce the full model's logits
    first_layers = ("0", "1", "2")
    tokens = torch.randint(0, DEBUG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = debug_model.tok_embeddings(tokens)
        for lid in first_layers:
            h = debug_model.layers[lid](h, debug_model.rope)
        torch.testing.assert_close(stage(h), debug_model(tokens), rtol=1e-5, atol=1e-5)


def test_an_aux_loss_adds_its_gradient_only_in_a_collected_step():
    from titan.models.common.aux_loss import AuxLossCollector, attach_aux_loss

    def grad(collect: bool):
        x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
        with AuxLossCollector(0.25) if collect else contextlib.nullcontext() as aux:
            h = attach_aux_loss(x * 2, "square", (x**2).sum())
            assert torch.equal(h, x * 2)  # the output is unchanged
            h.sum().backward()
        return x.grad, aux

    plain, _ = grad(False)
    assert torch.equal(plain, torch.full((3,), 2.0))
    with_aux, aux = grad(True)
    x = torch.tensor([1.0, -2.0, 3.0])
    assert torch.allclose(with_aux, 2 + 0.25 * 2 * x)  # weighted like one microbatch of four
    assert aux.floats() == {"square": 0.25 * 14.0}


def test_llama_on_the_common_blocks_is_the_model_it_was():
    """Llama 3 rebuilt on titan/models/common: the same parameter names and shapes (so older
    checkpoints and HF exports load) and the same logits as the Llama of before the rebuild
    (figures recorded from it; fp32 on any CPU agrees to ~1e-6)."""
    import hashlib

    args = LLAMA3_FLAVORS["debugmodel"].with_updates(
        max_seq_len=32, rope_scaling_factor=8.0, rope_original_max_len=16
    )
    model = Transformer(args)
    model.init_weights(0)
    names = ";".join(f"{k}:{tuple(v.shape)}" for k, v in model.state_dict().items())
    assert hashlib.sha256(names.encode()).hexdigest()[:16] == "af5e1f5f01b54d00"
    x = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x).double()
    assert out.abs().sum().item() == pytest.approx(103335.39147105918, rel=1e-5)
    torch.testing.assert_close(
        out[1, -1, :3].float(),
        torch.tensor([0.48832303285598755, -0.9125667214393616, 1.1642601490020752]),
        rtol=0,
        atol=1e-4,
    )
