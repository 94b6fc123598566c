"""The training objective: the cross-entropy over the counted tokens plus the registered terms
with their weights, logged by name; a plugin's term (the example's z-loss) trains alike on
1 rank, FSDP 2, TP 2 and PP 2."""

import sys

import pytest
import torch

from tests.example_plugin import registered
from tests.forked import run_trainer, tiny_run
from titan.components.training.loss import IGNORE_INDEX, cross_entropy_sum
from titan.components.training.objective import Objective
from titan.components.training.terms import build_terms, register_term, unregister_term
from titan.config import ConfigError, parse_args
from titan.parallelisms.token_split import TokenSplit


@pytest.fixture
def z_loss():
    with registered("z_loss.py", "z_loss", register_term, unregister_term) as m:
        yield m


def batch(masked: int = 0):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (2, 6), generator=gen)
    labels[0, :masked] = IGNORE_INDEX
    return logits, labels


def test_without_terms_the_objective_is_the_cross_entropy_mean():
    logits, labels = batch(masked=2)
    objective = Objective({}, tokens_per_rank_step=12, cp=1)
    objective.count([labels], None)  # 2 of 12 labels are not counted
    with objective.step(1.0, TokenSplit()):
        loss = objective.loss(logits, labels)
    assert torch.equal(loss, cross_entropy_sum(logits, labels) / 10)
    assert objective.reduce(None, None) == {"loss": loss.item()}


def test_a_terms_weight_is_in_backward_and_its_value_is_logged_unweighted(z_loss):
    logits, labels = batch(masked=2)
    logits.requires_grad_(True)
    (term,) = build_terms(parse_args(["--z_loss.weight", "0.5"])).values()
    objective = Objective({"z_loss": term}, tokens_per_rank_step=12, cp=2)
    objective.count([labels], None)  # 10 counted; per cp rank: 10 / 2 tokens
    with objective.step(1.0, TokenSplit()):
        objective.loss(logits, labels).backward()
    z = torch.logsumexp(logits.detach(), -1).square()[labels != IGNORE_INDEX].sum()
    ce = cross_entropy_sum(logits.detach(), labels)
    got = objective.reduce(None, None)
    assert got["loss"] == pytest.approx((ce / 5).item(), rel=1e-6)
    assert got["z_loss"] == pytest.approx((z / 5).item(), rel=1e-6)
    # the gradient is the weighted sum's
    ref = logits.detach().clone().requires_grad_(True)
    ((cross_entropy_sum(ref, labels) + 0.5 * term.token_sum(ref, labels)) / 5).backward()
    assert torch.allclose(logits.grad, ref.grad, rtol=1e-6, atol=0)


def test_a_term_is_checked_and_refused_where_there_are_no_logits(z_loss):
    with pytest.raises(ConfigError, match=r"z_loss.weight = -1.0: give a value >= 0"):
        parse_args(["--z_loss.weight", "-1"])
    terms = build_terms(parse_args(["--z_loss.weight", "1e-4"]))
    with pytest.raises(ConfigError, match=r"objective terms \['z_loss'\] need the output logits"):
        Objective(terms, 12, 1, logits=False)
    assert build_terms(parse_args([])) == {}  # weight 0: off


LAYOUTS = {
    "fsdp2": [],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_a_plugins_term_trains_alike_on_every_layout(z_loss, tmp_path):
    argv = [*tiny_run(4), "--z_loss.weight", "0.01"]
    one = run_trainer(tmp_path / "one", 1, argv)
    plain = run_trainer(tmp_path / "plain", 1, tiny_run(4))
    assert "z_loss" not in plain[0]
    # the term trains: the step after the first differs from the run without it
    assert one[0]["loss"] == plain[0]["loss"] and one[1]["loss"] != plain[1]["loss"]
    for name, flags in LAYOUTS.items():
        got = run_trainer(tmp_path / name, 2, [*argv, *flags])
        for key in ("loss", "z_loss"):
            worst = max(abs(a[key] - b[key]) / a[key] for a, b in zip(one, got, strict=True))
            assert worst < 1e-5, (name, key, one, got)
