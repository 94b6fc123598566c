"""LR schedule: warmup, stable phase (WSD), linear/sqrt/cosine decay, min-lr floor."""

import math

import pytest
import torch

from titan.components.optim.lr_scheduler import build_lr_scheduler, lr_factor
from titan.components.optim.lr_scheduler_spec import LRScheduler


def f(step, total=100, warmup=10, decay_ratio=None, decay_type="linear", min_lr=0.0):
    return lr_factor(step, total, warmup, decay_ratio, decay_type, min_lr)


def test_a_warmup_longer_than_the_run_is_cut_and_said(caplog):
    import logging

    from titan.components.optim.lr_scheduler import build_lr_scheduler
    from titan.config import parse_args

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level(logging.WARNING, logger="titan.components.optim.lr_scheduler"):
        sched = build_lr_scheduler(
            opt, parse_args(["--lr_scheduler.warmup_steps", "8"]).lr_scheduler, total_steps=4
        )
    assert (
        "lr_scheduler.warmup_steps 8 exceeds training.steps 4: the warmup is cut to 4"
        in caplog.text
    )
    for _ in range(3):
        sched.step()
    assert sched.get_last_lr() == [pytest.approx(1.0)]  # the peak at the last of the 4 steps


def test_warmup_linear_from_near_zero():
    assert f(1) == pytest.approx(0.1)
    assert f(5) == pytest.approx(0.5)
    assert f(10) == pytest.approx(1.0)  # peak reached on the last warmup step
    assert [f(s, warmup=4) for s in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize(
    "decay_type,step,expected",
    [
        # decay over steps 11..100 (90 steps); progress = (step - 10) / 90
        ("linear", 55, 0.5),
        ("linear", 19, 0.9),
        ("linear", 100, 0.0),
        ("cosine", 55, 0.5),
        ("cosine", 32.5, 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("cosine", 100, 0.0),
        ("sqrt", 32.5, 0.5),  # 1 - sqrt(0.25)
        ("sqrt", 19, 1 - math.sqrt(0.1)),
        ("sqrt", 100, 0.0),
    ],
)
def test_decay_shapes(decay_type, step, expected):
    assert f(step, decay_type=decay_type) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_monotone_after_warmup(decay_type):
    values = [f(s, decay_type=decay_type) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[0] == 1.0 and values[-1] == 0.0


def test_wsd_flat_until_80_percent_then_decay():
    kw = dict(decay_ratio=0.2)
    assert f(5, **kw) == pytest.approx(0.5)  # warmup unchanged
    assert all(f(s, **kw) == 1.0 for s in range(10, 81))  # stable phase
    assert f(81, **kw) == pytest.approx(1 - 1 / 20)
    assert f(90, **kw) == pytest.approx(0.5)
    assert f(100, **kw) == pytest.approx(0.0)
    assert f(90, decay_ratio=0.2, decay_type="cosine") == pytest.approx(0.5)
    assert f(85, decay_ratio=0.2, decay_type="sqrt") == pytest.approx(1 - math.sqrt(0.25))


def test_decay_ratio_zero_is_constant():
    assert all(f(s, decay_ratio=0.0) == 1.0 for s in range(10, 101))


def test_min_lr_floor():
    kw = dict(min_lr=0.1)
    assert f(100, **kw) == pytest.approx(0.1)
    assert f(55, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(10, **kw) == pytest.approx(1.0)
    assert f(100, decay_type="cosine", **kw) == pytest.approx(0.1)
    # past the end the factor stays at the floor
    assert f(150, **kw) == pytest.approx(0.1)
    assert min(
        f(s, decay_type=t, **kw)
        for s in range(1, 120)
        for t in ("linear", "cosine", "sqrt")
        if s > 10
    ) == pytest.approx(0.1)


def test_no_warmup():
    assert f(1, warmup=0) == pytest.approx(1 - 1 / 100)
    assert f(50, warmup=0) == pytest.approx(0.5)
    assert f(100, warmup=0) == pytest.approx(0.0)
    assert f(1, warmup=0, decay_ratio=0.2) == 1.0


def test_total_steps_shorter_than_warmup():
    # warmup is cut to the run length: ramps to the peak by the last step, never above it
    values = [f(s, total=5, warmup=10) for s in range(1, 6)]
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_unknown_decay_type():
    with pytest.raises(ValueError, match="decay_type"):
        f(50, decay_type="exp")


@pytest.mark.parametrize(
    "kw",
    [
        dict(warmup=3, decay_ratio=None, decay_type="cosine", min_lr=0.0),
        dict(warmup=2, decay_ratio=0.5, decay_type="linear", min_lr=0.2),
        dict(warmup=0, decay_ratio=None, decay_type="sqrt", min_lr=0.0),
    ],
)
def test_scheduler_lr_used_at_each_step(kw):
    """With SGD and grad 1, the update of step s is exactly the lr of step s."""
    peak, total = 0.5, 12
    p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=peak)
    sched = build_lr_scheduler(
        opt,
        LRScheduler(
            warmup_steps=kw["warmup"],
            decay_ratio=kw["decay_ratio"],
            decay_type=kw["decay_type"],
            min_lr_factor=kw["min_lr"],
        ),
        total,
    )
    for step in range(1, total + 1):
        expected = peak * lr_factor(
            step, total, kw["warmup"], kw["decay_ratio"], kw["decay_type"], kw["min_lr"]
        )
        assert opt.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-15)
        before = p.item()
        p.grad = torch.ones_like(p)
        opt.step()
        assert before - p.item() == pytest.approx(expected, abs=1e-12)
        sched.step()


def test_scheduler_state_resume():
    def make():
        p = torch.nn.Parameter(torch.zeros(()))
        opt = torch.optim.SGD([p], lr=1.0)
        return opt, build_lr_scheduler(opt, LRScheduler(warmup_steps=5, decay_type="cosine"), 20)

    opt, sched = make()
    for _ in range(7):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_factor(9, 20, 5, None, "cosine", 0.0))
