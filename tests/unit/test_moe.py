"""The shared MoE layer: its routers and routed experts against a per-token reference and
against transformers' Qwen3-MoE and DeepSeek-V3 blocks (when transformers is installed)."""

import pytest
import torch
import torch.nn.functional as F

from titan.models.common.init import normal, seeded_init_all
from titan.models.common.moe import MoE, MoEArgs

DIM = 64


def built(args: MoEArgs, seed: int = 0) -> MoE:
    moe = MoE(DIM, args)
    seeded_init_all(moe, moe.param_inits(normal(0.02)), seed)
    return moe


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its k experts, one at a time."""
    weights, indices, _ = moe.router(x)
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, i in zip(weights[t], indices[t]):
            h = F.silu(x[t] @ e.w1[i].T) * (x[t] @ e.w3[i].T)
            out[t] += w * (h @ e.w2[i].T)
    if moe.shared_experts is not None:
        out += moe.shared_experts(x)
    return out


@pytest.mark.parametrize(
    "args",
    [
        MoEArgs(n_experts=8, top_k=2, hidden_dim=32),
        MoEArgs(n_experts=8, top_k=3, hidden_dim=32, norm_topk_prob=False),
        MoEArgs(
            n_experts=16,
            top_k=4,
            hidden_dim=32,
            score_func="sigmoid",
            n_groups=4,
            topk_groups=2,
            route_scale=2.5,
            score_bias=True,
            n_shared_experts=2,
        ),
    ],
    ids=["softmax", "softmax_unnormalized", "sigmoid_groups_bias_shared"],
)
def test_every_token_reaches_all_its_experts(args):
    torch.manual_seed(0)
    moe = built(args)
    if args.score_bias:
        moe.router.expert_bias.copy_(torch.randn(args.n_experts) * 0.1)
    x = torch.randn(2, 24, DIM)
    out = moe(x)
    ref = per_token_reference(moe, x.reshape(-1, DIM)).view_as(x)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_dropless_when_every_token_picks_the_same_experts():
    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=32)
    moe = built(args)
    with torch.no_grad():  # experts 5 and 2 win for every token, by far
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[5, 0], moe.router.gate.weight[2, 0] = 50.0, 40.0
    x = torch.randn(40, DIM).abs() + 0.5
    weights, indices, _ = moe.router(x)
    assert (indices[:, 0] == 5).all() and (indices[:, 1] == 2).all()
    out = moe(x)
    torch.testing.assert_close(out, per_token_reference(moe, x), atol=2e-6, rtol=1e-5)
    out.sum().backward()
    # gradients reach the chosen experts and the router; the others' slices stay zero
    assert moe.experts.w1.grad[[2, 5]].abs().sum() > 0
    assert moe.experts.w1.grad[[0, 1, 3, 4, 6, 7]].abs().sum() == 0
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_score_bias_steers_the_choice_but_not_the_weights():
    args = MoEArgs(
        n_experts=8,
        top_k=2,
        hidden_dim=32,
        score_func="sigmoid",
        score_bias=True,
        norm_topk_prob=False,
    )
    moe = built(args)
    x = torch.randn(16, DIM)
    _, _, scores = moe.router(x)
    moe.router.expert_bias[3] = 10.0  # expert 3 is chosen by every token
    weights, indices, _ = moe.router(x)
    assert (indices == 3).any(dim=1).all()
    torch.testing.assert_close(weights, scores.gather(1, indices))  # unbiased scores


@pytest.mark.parametrize("kind", ["swiglu", "biases_own_activation"])
def test_grouped_gemm_equals_the_per_expert_loop_bit_for_bit(monkeypatch, kind):
    """Also with biases (added after the products on both paths) and a family's activation."""
    import titan.models.common.moe as moe_module

    if not moe_module._grouped_mm_fits(torch.zeros(1, 8), torch.zeros(1, 8, 8)):
        pytest.skip("this torch has no CPU grouped GEMM")
    moe = built(MoEArgs(n_experts=8, top_k=2, hidden_dim=32)) if kind == "swiglu" else injected()
    experts = moe.experts
    counts = torch.tensor([5, 0, 7, 1, 2, 9, 0, 6])  # empty experts too
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    grad = torch.randn(int(counts.sum()), DIM)

    def run():
        out = experts(x, counts)
        out.backward(grad)
        grads = (x.grad.clone(), *(p.grad.clone() for p in experts.parameters()))
        x.grad = None
        experts.zero_grad(set_to_none=True)
        return out.detach(), grads

    grouped = run()
    monkeypatch.setattr(moe_module, "_grouped_mm_fits", lambda x, w: False)
    loop = run()
    assert torch.equal(grouped[0], loop[0])
    assert all(torch.equal(a, b) for a, b in zip(grouped[1], loop[1], strict=True))


@pytest.mark.parametrize(
    "bad, fields",
    [
        (dict(top_k=9), "top_k 9"),
        (dict(n_groups=3), "n_groups 3 must divide n_experts 8"),
        (dict(n_groups=8), "fewer than 2 experts per group"),
        (dict(n_groups=4, topk_groups=5), "topk_groups 5"),
        (dict(n_groups=4, topk_groups=1, top_k=3), "top_k 3 exceeds the 2 experts"),
        (dict(score_func="relu"), "score_func 'relu'"),
    ],
)
def test_bad_settings_are_named(bad, fields):
    args = MoEArgs(**{**dict(n_experts=8, top_k=2), **bad})
    assert any(fields in p for p in args.problems()), args.problems()
    with pytest.raises(ValueError, match="MoE settings"):
        MoE(DIM, args)


# ---------------------------------------------------------------- transformers as reference


def _hf_experts_from(moe: MoE, hf_experts) -> None:
    e = moe.experts
    with torch.no_grad():
        hf_experts.gate_up_proj.copy_(torch.cat([e.w1, e.w3], dim=1))
        hf_experts.down_proj.copy_(e.w2)


@pytest.mark.needs("transformers")
def test_equals_transformers_qwen3_moe_block():
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=DIM,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    moe = built(MoEArgs(n_experts=8, top_k=2, hidden_dim=32, norm_topk_prob=True))
    hf = Qwen3MoeSparseMoeBlock(cfg)
    _hf_experts_from(moe, hf.experts)
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router.gate.weight)
    x = torch.randn(2, 24, DIM)
    torch.testing.assert_close(moe(x), hf(x), atol=1e-6, rtol=1e-5)


@pytest.mark.needs("transformers")
def test_equals_transformers_deepseek_v3_moe():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=DIM,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        n_shared_experts=2,
        norm_topk_prob=True,
    )
    moe = built(
        MoEArgs(
            n_experts=16,
            top_k=4,
            hidden_dim=32,
            score_func="sigmoid",
            n_groups=4,
            topk_groups=2,
            route_scale=2.5,
            score_bias=True,
            n_shared_experts=2,
        )
    )
    hf = DeepseekV3MoE(cfg)
    _hf_experts_from(moe, hf.experts)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.randn(16) * 0.05)
        hf.gate.weight.copy_(moe.router.gate.weight)
        hf.gate.e_score_correction_bias.copy_(moe.router.expert_bias)
        for n in ("gate_proj", "up_proj", "down_proj"):
            ours = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[n]
            getattr(hf.shared_experts, n).weight.copy_(getattr(moe.shared_experts, ours).weight)
    x = torch.randn(2, 24, DIM)
    torch.testing.assert_close(moe(x), hf(x), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- load balancing


def test_bias_update_moves_every_expert_towards_the_mean_load():
    from titan.models.common.moe import update_expert_bias_

    bias = torch.zeros(4)
    update_expert_bias_(bias, torch.tensor([10.0, 2.0, 6.0, 6.0]), rate=0.001)
    assert torch.equal(bias, torch.tensor([-0.001, 0.001, 0.0, 0.0]))
    # counts summed over more microbatches or ranks, or counted twice by a recomputed
    # forward, scale alike: the same move
    update_expert_bias_(bias, torch.tensor([20.0, 4.0, 12.0, 12.0]), rate=0.001)
    assert torch.equal(bias, torch.tensor([-0.002, 0.002, 0.0, 0.0]))


def test_balance_losses_are_at_their_minimum_when_balanced():
    from titan.models.common.moe import load_balancing_loss, sequence_balance_loss

    n, e, k = 8, 4, 2
    scores = torch.full((n, e), 1 / e)
    indices = torch.tensor([[0, 1], [2, 3]] * (n // 2))
    assert load_balancing_loss(scores, indices).item() == pytest.approx(k)
    assert sequence_balance_loss(scores, indices, seq_len=4).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0, 1]] * n)
    peaked = torch.tensor([[0.7, 0.2, 0.05, 0.05]] * n)
    assert load_balancing_loss(peaked, skewed) > k
    assert sequence_balance_loss(peaked, skewed, seq_len=4) > 1.0


@pytest.mark.needs("transformers")
def test_load_balancing_loss_equals_transformers_for_one_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from titan.models.common.moe import load_balancing_loss

    moe = built(MoEArgs(n_experts=8, top_k=2, hidden_dim=32))
    x = torch.randn(48, DIM)
    _, indices, scores = moe.router(x)
    ours = load_balancing_loss(scores, indices)
    theirs = load_balancing_loss_func((moe.router.gate(x),), num_experts=8, top_k=2)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    ours.backward()  # the scores carry the gradient to the router
    assert moe.router.gate.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- parts a family passes in


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.05) -> torch.Tensor:
    """A family's own activation (GPT-OSS's shape: clamped, sigmoid-gated, up + 1)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def injected(seed: int = 0) -> MoE:
    from titan.models.common.feed_forward import FeedForward
    from titan.models.common.moe import GroupedExperts, Router

    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=32)
    moe = MoE(
        DIM,
        args,
        router=Router(DIM, args, bias=True),
        experts=GroupedExperts(DIM, 32, 8, activation=clamped_swiglu, bias=True),
        shared=FeedForward(DIM, 48),
    )
    inits = moe.param_inits(normal(0.02))
    params = {n for n, _ in moe.named_parameters()}
    assert params <= set(inits), params - set(inits)  # every parameter has its fill
    seeded_init_all(moe, inits, seed)
    with torch.no_grad():  # biases start at zero: make them matter
        for n, p in moe.named_parameters():
            if n.endswith(("b1", "b2", "b3", "gate.bias")):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return moe


def test_injected_router_experts_and_shared_compute_as_written():
    moe = injected()
    x = torch.randn(12, DIM, generator=torch.Generator().manual_seed(3))
    weights, indices, _ = moe.router(x)
    g = moe.router.gate
    assert torch.allclose(moe.router.gate(x), x @ g.weight.T + g.bias)
    e = moe.experts
    want = moe.shared_experts(x).clone()
    for t in range(x.shape[0]):
        for w, i in zip(weights[t], indices[t], strict=True):
            h = clamped_swiglu(x[t] @ e.w1[i].T + e.b1[i], x[t] @ e.w3[i].T + e.b3[i])
            want[t] += w * (h @ e.w2[i].T + e.b2[i])
    got = moe(x[None])[0]
    assert torch.allclose(got, want, atol=1e-6)


def test_under_autocast_the_experts_take_one_grouped_gemm_per_weight(monkeypatch):
    """bf16 autocast with fp32 parameters (a one-GPU run): 3 grouped GEMMs in bf16 forward, 6
    backward (each weight's and its input's gradient), no per-expert product; the same
    products as the per-expert loop under the same autocast, and fp32 gradients."""
    import titan.models.common.moe as moe_module
    from tests.dispatch_count import DispatchCount

    experts = built(MoEArgs(n_experts=8, top_k=2, hidden_dim=32)).experts
    counts = torch.tensor([5, 0, 7, 1, 2, 9, 0, 6])
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    grad = torch.randn(int(counts.sum()), DIM, dtype=torch.bfloat16)

    def run(count: DispatchCount):
        with count, torch.autocast("cpu", torch.bfloat16):
            out = experts(x, counts)
        forward = count.ops.copy()
        with count:
            out.backward(grad)
        backward = count.ops - forward
        grads = (x.grad, *(p.grad for p in experts.parameters()))
        x.grad = None
        experts.zero_grad(set_to_none=True)
        return out, dict(forward), dict(backward), grads

    out, forward, backward, grads = run(DispatchCount())
    matmuls = {f"aten.{op}" for op in ("mm", "addmm", "bmm", "matmul", "linear")}
    assert forward.get("aten._grouped_mm") == 3 and not matmuls & forward.keys(), forward
    assert backward.get("aten._grouped_mm") == 6 and not matmuls & backward.keys(), backward
    assert out.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads[1:])
    monkeypatch.setattr(moe_module, "_grouped_mm_fits", lambda x, w: False)
    loop_out, loop_forward, _, loop_grads = run(DispatchCount())
    assert loop_forward.get("aten._grouped_mm", 0) == 0  # the reference really is the loop
    assert torch.equal(out, loop_out)
    for g, want in zip(grads, loop_grads, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
