"""Gradient clipping: plain tensors match torch's own; the CPU norm is float32-exact, sharded
or not."""

import sys

import pytest
import torch

from titan.components.optim.grad_clip import clip_grad_norm_


def params_with_grads(scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 8), (16,), (3, 3, 3), ()]
    ps = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g) * scale
        ps.append(p)
    return ps


def clone(ps):
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("scale,max_norm", [(1.0, 1.0), (10.0, 0.5), (0.01, 1.0), (1.0, 100.0)])
def test_matches_torch(scale, max_norm):
    ours = params_with_grads(scale)
    ref = clone(ours)
    total = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert isinstance(total, torch.Tensor) and total.dim() == 0
    torch.testing.assert_close(total, expected)
    by_hand = torch.cat([p.grad.flatten() for p in clone(params_with_grads(scale))]).norm()
    torch.testing.assert_close(total, by_hand)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    clipped = torch.cat([p.grad.flatten() for p in ours]).norm().item()
    assert clipped == pytest.approx(min(by_hand.item(), max_norm), rel=1e-4)


def test_max_norm_zero_measures_only():
    ps = params_with_grads(scale=10.0)
    before = [p.grad.clone() for p in ps]
    total = clip_grad_norm_(ps, 0.0)
    expected = torch.cat([g.flatten() for g in before]).norm()
    torch.testing.assert_close(total, expected)
    assert total.item() > 10
    for p, g in zip(ps, before):
        assert torch.equal(p.grad, g)


def test_params_without_grad_are_skipped():
    ps = params_with_grads()
    extra = torch.nn.Parameter(torch.ones(5))  # no .grad
    total = clip_grad_norm_(ps + [extra], 0.0)
    torch.testing.assert_close(total, torch.cat([p.grad.flatten() for p in ps]).norm())
    assert extra.grad is None


def test_accepts_a_generator():
    ps = params_with_grads(scale=5.0)
    ref = clone(ps)
    total = clip_grad_norm_((p for p in ps), 1.0)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(ref, 1.0))
    torch.testing.assert_close(ps[0].grad, ref[0].grad)


def wide_gradient(seed=0) -> torch.Tensor:
    """An embedding-sized gradient whose columns span four decades, like a real one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2048, 256, generator=g) * torch.logspace(-4, 0, 256) + 1e-3


def test_cpu_norm_is_float32_exact():
    # torch's float32 CPU norm kernel is 1e-5 to 1e-4 off on such a gradient; a float64 sum of
    # the float32 squares is off by their rounding only, well inside two float32 ulps
    p = torch.nn.Parameter(torch.zeros(2048, 256))
    p.grad = wide_gradient()
    exact = p.grad.double().norm().item()
    assert abs(clip_grad_norm_([p], 0.0).item() - exact) <= 2**-23 * exact


def _sharded_norm(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for placement in (Shard(0), _StridedShard(0, split_factor=2)):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(2048, 256), mesh, [placement]))
        p.grad = distribute_tensor(wide_gradient(), mesh, [placement])
        out.append(clip_grad_norm_([p], 0.0).item())
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_sharded_norm_equals_one_rank(tmp_path):
    """FSDP's shards (and FSDP over TP's strided shards) give one rank's norm: each shard's
    squares are summed over the mesh dims it is split on."""
    from tests.forked import run_workers

    p = torch.nn.Parameter(torch.zeros(2048, 256))
    p.grad = wide_gradient()
    one = clip_grad_norm_([p], 0.0).item()
    for rank_result in run_workers(_sharded_norm, 2, tmp_path):
        for total in rank_result:
            assert abs(total - one) <= 2**-23 * one, (total, one)
