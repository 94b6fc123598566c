"""Token dropping with a capacity factor and ST-MoE's router z-loss (issue 50): the MoE layer
against references written out here, one choice and one token at a time; the layouts that
keep the routing group (a sequence) drop the same choices and train like one process, with
the z-loss on; the training settings are checked."""

import math
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.forked import run_trainer, tiny_run
from tests.layouts import degrees, layouts
from titan.models.common.aux_loss import AuxLossCollector
from titan.models.common.init import normal, seeded_init_all
from titan.models.common.moe import MoE, MoEArgs

DIM = 32


def built(args: MoEArgs, seed: int = 0) -> MoE:
    moe = MoE(DIM, args)
    seeded_init_all(moe, moe.param_inits(normal(0.02)), seed)
    return moe


def expert(moe: MoE, e: int, t: torch.Tensor) -> torch.Tensor:
    w = moe.experts
    return (F.silu(t @ w.w1[e].T) * (t @ w.w3[e].T)) @ w.w2[e].T


def reference(moe: MoE, x: torch.Tensor, seq: int) -> tuple[torch.Tensor, int]:
    """(output, dropped choices): per sequence and expert, the choices routed to it ranked by
    the policy (weight, highest first, then position; or position), the first `capacity`
    kept; each token sums weight x expert over its kept choices."""
    a = moe.args
    flat = x.reshape(-1, DIM)
    weights, indices, _ = moe.router(flat)
    capacity = math.ceil(seq * a.top_k / a.n_experts * a.capacity_factor)
    out = torch.zeros_like(flat)
    dropped = 0
    for s in range(flat.shape[0] // seq):
        for e in range(a.n_experts):
            choices = [
                (t, j)
                for t in range(s * seq, (s + 1) * seq)
                for j in range(a.top_k)
                if indices[t, j] == e
            ]
            if a.drop_policy == "probs":
                choices.sort(key=lambda c: -weights[c].item())  # stable: position breaks ties
            dropped += max(0, len(choices) - capacity)
            for t, j in choices[:capacity]:
                out[t] += weights[t, j] * expert(moe, e, flat[t])
    return out.view_as(x), dropped


# every token picks among 4 of 8 experts, so some experts overflow at factor 1
SKEWED = MoEArgs(n_experts=8, top_k=2, hidden_dim=16, capacity_factor=1.0)


def skewed_input(seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 16, DIM, generator=gen)  # 3 sequences of 16 tokens


def skewed_moe(args: MoEArgs) -> MoE:
    moe = built(args)
    with torch.no_grad():  # a router that prefers experts 0-3
        moe.router.gate.weight[4:] *= 0.1
        moe.router.gate.weight[:4] += 0.05
    return moe


@pytest.mark.parametrize("pad", [False, True], ids=["dropped", "padded"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_the_choices_the_reference_keeps(policy, pad):
    args = replace(SKEWED, drop_policy=policy, pad_to_capacity=pad)
    moe = skewed_moe(args)
    x = skewed_input().requires_grad_()
    want, want_dropped = reference(moe, x.detach(), seq=16)
    assert want_dropped > 0  # the case this is about
    with AuxLossCollector(1.0):
        got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert moe.dropped.item() == want_dropped
    # the gradient: what the reference's differentiable sum gives
    got.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    xr = x.detach().requires_grad_()
    reference(moe, xr, seq=16)[0].square().sum().backward()
    for n, p in moe.named_parameters():
        if "gate" in n:  # the choice itself is discrete: the weights' gradients flow alike
            continue
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-7)


def test_a_token_that_loses_every_choice_passes_through_only():
    """Capacity 1 per expert and sequence: most tokens lose both choices; theirs is zero (the
    residual alone carries them), with no gradient reaching them through the experts."""
    args = replace(SKEWED, capacity_factor=0.25)  # ceil(16 x 2 / 8 x 0.25) = 1
    moe = skewed_moe(args)
    x = skewed_input().requires_grad_()
    out = moe(x)
    want, _ = reference(moe, x.detach(), seq=16)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    lost = (want.abs().sum(dim=-1) == 0).flatten()
    assert lost.sum() > 20  # of 48 tokens
    out.sum().backward()
    assert (x.grad.reshape(-1, DIM)[lost] == 0).all()


def test_enough_capacity_is_dropless_to_the_bit():
    """A capacity no expert can overflow (factor n_experts / k: every choice of a sequence)."""
    moe = skewed_moe(replace(SKEWED, capacity_factor=4.0))
    dropless = skewed_moe(replace(SKEWED, capacity_factor=None))
    x = skewed_input()
    assert torch.equal(moe(x), dropless(x))


def test_capacity_and_drops_read_nothing_on_the_host():
    from tests.dispatch_count import DispatchCount

    for pad in (False, True):
        moe = skewed_moe(replace(SKEWED, pad_to_capacity=pad))
        with DispatchCount() as count, AuxLossCollector(1.0):
            moe(skewed_input()).sum().backward()
        assert count.host_reads == [] and count.tolist == 0, (pad, count.host_reads)


def test_router_z_loss_is_the_mean_square_logsumexp():
    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=16, router_z_loss_coeff=1e-3)
    moe = built(args)
    x = skewed_input().requires_grad_()
    with AuxLossCollector(1.0) as aux:
        out = moe(x)
    logits = moe.router.gate(x.reshape(-1, DIM))
    z = torch.logsumexp(logits, dim=-1).square().mean()
    assert aux.floats()["moe_z_loss"] == pytest.approx(1e-3 * z.item(), rel=1e-6)
    # its gradient reaches the router as 1e-3 x dz/dW would
    out.sum().backward()
    with_z = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    with AuxLossCollector(1.0):
        moe(x).sum().backward()
    no_z = built(replace(args, router_z_loss_coeff=0.0))
    with AuxLossCollector(1.0):
        no_z(x).sum().backward()
    dz = torch.autograd.grad(1e-3 * z, moe.router.gate.weight)[0]
    torch.testing.assert_close(with_z - no_z.router.gate.weight.grad, dz, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    "bad, fields",
    [
        (dict(capacity_factor=0.0), "capacity_factor 0.0 must be > 0"),
        (dict(drop_policy="random"), "drop_policy 'random'"),
        (dict(pad_to_capacity=True), "pad_to_capacity needs a capacity_factor"),
        (dict(router_z_loss_coeff=-1.0), "router_z_loss_coeff -1.0 must be >= 0"),
    ],
)
def test_bad_settings_are_named(bad, fields):
    with pytest.raises(ValueError, match=fields):
        MoE(DIM, replace(SKEWED, **{"capacity_factor": None, **bad}))


# ------------------------------------------------------------------ layouts (forked ranks)

STEPS = 6
# DeepSeek-V3's debug model with its balance loss and bias update, the z-loss on and a
# capacity that drops choices in every step (logged as moe_dropped_pct)
ARGV = [
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "debugmodel",
    *tiny_run(STEPS),
    "--deepseek_v3.moe_router_z_loss_coeff",
    "0.001",
    "--deepseek_v3.moe_capacity_factor",
    "1.0",
]
# the routing group (each sequence) is the same on all of these; tensor parallelism without
# sequence parallelism gives each tp rank whole sequences too
LAYOUTS = {
    **layouts("fsdp2", "pp2"),
    "tp2_ep2_no_sp": (
        4,
        [
            *degrees(tensor_parallel=2, expert_parallel=2),
            "--parallelism.no_enable_sequence_parallel",
        ],
    ),
}


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.slow("one rank and three layouts of 2-4 forked ranks, 6 steps each")
def test_layouts_that_keep_the_group_drop_and_train_like_one_process(tmp_path):
    one = run_trainer(tmp_path / "one", 1, ARGV)
    assert all(r["moe_dropped_pct"] > 0 for r in one)  # choices dropped in every step
    assert all(r["moe_z_loss"] > 0 for r in one)
    for layout, (world, flags) in LAYOUTS.items():
        got = run_trainer(tmp_path / layout, world, [*ARGV, *flags], deadline_s=150)
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        for a, b in zip(one, got, strict=True):
            for key in ("loss", "moe_z_loss", "moe_aux_loss"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (layout, key, a, b)
            # the same choices dropped: the same count (an exact share of the same totals)
            assert a["moe_dropped_pct"] == pytest.approx(b["moe_dropped_pct"], rel=1e-9), (
                layout,
                a,
                b,
            )
