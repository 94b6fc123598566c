"""The training objective: the cross-entropy over the counted tokens plus the registered terms
with their weights, logged by name; a plugin's term (the example's mean squared logit) trains
alike on 1 rank, FSDP 2, TP 2, PP 2 and under the chunked loss (computed chunk by chunk); a
term that reads a batch field gets it cut as the labels are (pipeline microbatches, sequence
shards)."""

import sys

import pytest
import torch

from tests.example_plugin import registered
from tests.forked import run_trainer, tiny_run
from tests.layouts import layouts
from titan.components.data.dataset import DataError, unregister_dataset
from titan.components.training.loss import IGNORE_INDEX, cross_entropy_sum
from titan.components.training.objective import Objective
from titan.components.training.terms import (
    Term,
    TermSpec,
    build_terms,
    register_term,
    unregister_term,
)
from titan.config import ConfigError, extensions, parse_args
from titan.parallelisms.token_split import TokenSplit


@pytest.fixture
def logit_l2():
    with registered("logit_l2.py", "logit_l2", register_term, unregister_term) as m:
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
    assert objective.named(objective.reduce(None, None)) == {"loss": loss.item()}


def test_a_terms_weight_is_in_backward_and_its_value_is_logged_unweighted(logit_l2):
    logits, labels = batch(masked=2)
    logits.requires_grad_(True)
    (term,) = build_terms(parse_args(["--logit_l2.weight", "0.5"])).values()
    objective = Objective({"logit_l2": term}, tokens_per_rank_step=12, cp=2)
    objective.count([labels], None)  # 10 counted; per cp rank: 10 / 2 tokens
    with objective.step(1.0, TokenSplit()):
        objective.loss(logits, labels).backward()
    l2 = logits.detach().square().mean(-1)[labels != IGNORE_INDEX].sum()
    ce = cross_entropy_sum(logits.detach(), labels)
    got = objective.named(objective.reduce(None, None))
    assert got["loss"] == pytest.approx((ce / 5).item(), rel=1e-6)
    assert got["logit_l2"] == pytest.approx((l2 / 5).item(), rel=1e-6)
    # the gradient is the weighted sum's
    ref = logits.detach().clone().requires_grad_(True)
    ((cross_entropy_sum(ref, labels) + 0.5 * term.token_sum(ref, labels)) / 5).backward()
    assert torch.allclose(logits.grad, ref.grad, rtol=1e-6, atol=0)


def test_a_term_is_checked_and_off_at_weight_zero(logit_l2):
    with pytest.raises(ConfigError, match=r"logit_l2.weight = -1.0: give a value >= 0"):
        parse_args(["--logit_l2.weight", "-1"])
    assert build_terms(parse_args([])) == {}  # weight 0: off


LAYOUTS = {
    **layouts("tp2", "pp2"),
    "fsdp2": (2, []),
    # the output layer computes the term beside the cross-entropy, 24 tokens at a time
    "chunked": (1, ["--training.loss_chunk_tokens", "24"]),
}


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.slow("two 1-rank runs and a 2-rank run of each layout (31.5 s on CI's 2 cores)")
def test_a_plugins_term_trains_alike_on_every_layout(logit_l2, tmp_path):
    argv = [*tiny_run(4), "--logit_l2.weight", "0.01"]
    one = run_trainer(tmp_path / "one", 1, argv)
    plain = run_trainer(tmp_path / "plain", 1, tiny_run(4))
    assert "logit_l2" not in plain[0]
    # the term trains: the step after the first differs from the run without it
    assert one[0]["loss"] == plain[0]["loss"] and one[1]["loss"] != plain[1]["loss"]
    for name, (world, flags) in LAYOUTS.items():
        got = run_trainer(tmp_path / name, world, [*argv, *flags])
        for key in ("loss", "logit_l2"):
            worst = max(abs(a[key] - b[key]) / a[key] for a, b in zip(one, got, strict=True))
            assert worst < 1e-5, (name, key, one, got)


class PositionWeightedL2(Term):
    """The mean squared logit of each counted token, weighted by its position in its document
    (the example dataset's `positions` field): wrong wherever a token met another's field."""

    fields = ("positions",)
    weight = 0.01

    def token_sum(self, logits, labels, fields):
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        per_token = logits.float().square().mean(dim=-1) * fields["positions"].float()
        return (per_token * (labels != IGNORE_INDEX)).sum() / 100


def position_l2(job):
    return PositionWeightedL2()


@pytest.fixture
def fielded():
    """The term above and the example's dataset whose samples carry `positions`."""
    extensions.register(TermSpec("position_l2", build=f"{__name__}:position_l2"))
    try:
        with registered("data.py", "plugin_corpus", extensions.register, unregister_dataset):
            yield
    finally:
        unregister_term("position_l2")


def test_a_term_reads_the_fields_it_names_and_a_batch_without_them_is_refused(fielded):
    logits, labels = batch(masked=2)
    positions = torch.arange(6).repeat(2, 1)
    objective = Objective(build_terms(parse_args([])), tokens_per_rank_step=12, cp=1)
    assert objective.fields == ("positions",)
    target = objective.target({"input_ids": labels, "labels": labels, "positions": positions})
    assert target.shape == (2, 6, 2)  # the labels, then the field, split and sharded alike
    objective.count([labels], None)
    with objective.step(1.0, TokenSplit()):
        objective.loss(logits, target)
    got = objective.named(objective.reduce(None, None))["position_l2"]
    want = PositionWeightedL2().token_sum(logits, labels, {"positions": positions}) / 10
    assert got == pytest.approx(want.item(), rel=1e-6) and got > 0
    why = r"\['position_l2'\] read the batch field\(s\) \['positions'\]"
    with pytest.raises(DataError, match=why):
        objective.target({"input_ids": labels, "labels": labels})


def test_the_chunked_loss_refuses_a_term_that_reads_fields(fielded):
    from titan.plan.run_plan import plan_run

    job = parse_args(["--training.loss_chunk_tokens", "16", "--training.dataset", "plugin_corpus"])
    with pytest.raises(ConfigError, match=r"position_l2.*read batch fields"):
        plan_run(job, 1)


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.slow("a 1-rank run and two 2-rank runs (about 20 s on CI's 2 cores)")
def test_a_term_reading_a_field_trains_alike_when_pipelines_and_shards_cut_it(fielded, tmp_path):
    argv = [*tiny_run(3), "--training.dataset", "plugin_corpus"]
    one = run_trainer(tmp_path / "one", 1, argv)
    assert all(r["position_l2"] > 0 for r in one)
    for name, (world, flags) in layouts("pp2", "cp2").items():
        got = run_trainer(tmp_path / name, world, [*argv, *flags])
        for key in ("loss", "position_l2"):
            worst = max(abs(a[key] - b[key]) / a[key] for a, b in zip(one, got, strict=True))
            assert worst < 1e-5, (name, key, one, got)
