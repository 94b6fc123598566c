"""Gradient clipping on plain tensors matches torch's own."""

import pytest
import torch

from titan.components.grad_clip import clip_grad_norm_


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
