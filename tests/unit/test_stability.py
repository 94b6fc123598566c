"""Spike detection ([stability]): the score against a written-out mean and standard deviation;
the monitor's warm-up, log / skip / stop and its checkpointed window; a skipped step leaves the
weights and the optimizer state bitwise as they were (the lr schedule and the data move on);
FSDP 2, TP 2 and PP 2 flag and skip the same step as 1 rank; a run resumed before a flagged
step flags it again; on_spike = stop ends a launched run in one line."""

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.forked import TWO_RANK_LAYOUTS, run_trainer, tiny_run
from titan.components.training.callbacks import StopTraining
from titan.components.training.stability import SpikeMonitor, spike_score
from titan.config import ConfigError, parse_args
from titan.config.extensions import ignored_warning

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS, BAD = 10, 8
# the corrupted batch at step BAD: its loss ~10 sigma above the 4 steps before it, its
# gradient norm ~250 sigma (20 against ~1.3); no other step comes near 6 sigma
SPIKES = [
    "--stability.spike_window",
    "4",
    "--stability.on_spike",
    "skip",
    "--debug.bad_batch_at_step",
    str(BAD),
]
ARGV = [*tiny_run(STEPS), *SPIKES]


def test_spike_score_is_deviations_above_the_windows_mean():
    window = [1.0, 2.0, 3.0, 4.0]
    mean = (1 + 2 + 3 + 4) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in window) / 3)  # sample form
    assert spike_score(10.0, window) == pytest.approx((10.0 - mean) / std, rel=1e-15)
    assert spike_score(1.0, window) < 0  # below the mean: never a spike
    assert spike_score(2.0, [2.0, 2.0]) == 0.0 and spike_score(2.5, [2.0, 2.0]) == math.inf


def monitor(tmp_path, **kw) -> SpikeMonitor:
    # the section as the config makes it: importing its module here would register the
    # callback ahead of titan's own order (test_architecture checks that order)
    cfg = parse_args(["--stability.spike_window", "3", "--stability.spike_sigma", "3"]).stability
    for key, value in kw.items():
        setattr(cfg, key, value)
    m = SpikeMonitor(cfg, str(tmp_path), rank=0)
    m.on_train_start(SimpleNamespace(step=0, history_set_aside=None))
    return m


def test_the_monitor_warms_up_then_flags_what_the_window_does_not_hold(tmp_path):
    m = monitor(tmp_path, on_spike="skip")
    run = SimpleNamespace()
    # the window fills first: not even a huge value is judged before it is full
    for step, (loss, norm) in enumerate([(5.0, 1.0), (50.0, 1.1), (4.9, 0.9)], 1):
        assert m.judge_step(run, step, loss, norm) is None
    # window (5, 50, 4.9): mean 19.97, std 26.0; a grad norm of 9 is 36 sigma out
    reason = m.judge_step(run, 4, 4.8, 9.0)
    assert reason.startswith("grad_norm spike: loss 4.8 (") and reason.endswith("on_spike = skip)")
    assert m.figures(run, 4) == {"spikes": 1}
    # the spike joins the window (OLMo-core's rule): a lasting level stops being one
    assert list(m.windows["grad_norm"]) == [1.1, 0.9, 9.0]
    assert m.judge_step(run, 5, 4.7, 9.0) is None
    (record,) = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["flagged"] == ["grad_norm"]
    assert record["action"] == "skip" and record["grad_norm_sigma"] > 30

    logged = monitor(tmp_path / "log", on_spike="log", spike_metrics=["loss"])
    for step, loss in enumerate([3.0, 3.1, 2.9], 1):
        logged.judge_step(run, step, loss, 1.0)
    assert logged.judge_step(run, 4, 30.0, 1.0) is None and logged.spikes == 1  # logged only

    stop = monitor(tmp_path / "stop", on_spike="stop")
    for step, loss in enumerate([3.0, 3.1, 2.9], 1):
        stop.judge_step(run, step, loss, 1.0)
    with pytest.raises(StopTraining, match=r"step 4: loss spike: .*on_spike = stop"):
        stop.judge_step(run, 4, 30.0, 1.0)


def test_the_window_is_checkpointed_under_its_length(tmp_path):
    m = monitor(tmp_path, spike_metrics=["loss"])
    for step, loss in enumerate([3.0, 3.5], 1):
        m.judge_step(None, step, loss, 1.0)
    state = m.state_dict()
    # tensors of the window's length (unfilled slots NaN), keyed by it: a run resumed with
    # another spike_window finds no key of its own and starts its window afresh
    assert set(state) == {"spikes", "loss_last3"} and state["loss_last3"].shape == (3,)
    back = monitor(tmp_path / "b", spike_metrics=["loss"])
    back.load_state_dict(state)
    assert list(back.windows["loss"]) == [3.0, 3.5] and back.spikes == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stability.spike_window", "1"], "needs at least 2 steps"),
        (["--stability.spike_window", "8", "--stability.spike_sigma", "0"], "must be > 0"),
        (["--stability.spike_window", "8", "--stability.spike_metrics", "los"], "loss, grad_norm"),
    ],
)
def test_bad_settings_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(flags)


def test_settings_without_a_window_are_named_as_ignored():
    job = parse_args(["--stability.on_spike", "skip"])
    assert "stability.on_spike (stability.spike_window is 0" in ignored_warning(job)


def dcp_state(step_dir, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def spikes_of(dump) -> list[dict]:
    return [json.loads(x) for x in (dump / "spikes.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """1 rank, a checkpoint after every step: (metrics records, dump folder)."""
    tmp = tmp_path_factory.mktemp("one_rank")
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
    records = run_trainer(tmp, 1, [*ARGV, *ckpt], deadline_s=120)
    return records, tmp / "dump"


def test_a_skipped_step_changes_no_weight_and_no_optimizer_state(one_rank, tmp_path):
    records, dump = one_rank
    assert [s["step"] for s in spikes_of(dump)] == [BAD]
    assert [r.get("skipped_steps", 0) for r in records] == [0] * (BAD - 1) + [1] * 3
    assert records[BAD - 1]["spikes"] == 1 and records[BAD - 1]["loss"] > records[BAD - 2]["loss"]
    before = dcp_state(dump / "checkpoint" / f"step-{BAD - 1}", tmp_path)
    after = dcp_state(dump / "checkpoint" / f"step-{BAD}", tmp_path)
    for part in ("model", "optimizer"):
        flat_before, flat_after = _flatten(before[part]), _flatten(after[part])
        assert flat_before.keys() == flat_after.keys()
        changed = [k for k in flat_before if not _same(flat_before[k], flat_after[k])]
        assert changed == [], (part, changed[:5])
    # the schedule and the data moved on by one step, as after any other
    for part in ("lr_scheduler", "dataloader"):
        flat_before, flat_after = _flatten(before[part]), _flatten(after[part])
        assert not all(_same(flat_before[k], flat_after[k]) for k in flat_before), part
    # and the step after it updates again
    nxt = dcp_state(dump / "checkpoint" / f"step-{BAD + 1}", tmp_path)
    assert not all(
        _same(a, b)
        for a, b in zip(_flatten(after["model"]).values(), _flatten(nxt["model"]).values())
    )


def _flatten(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        return _flatten(dict(enumerate(tree)), prefix)
    return {prefix: tree}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


LAYOUTS = TWO_RANK_LAYOUTS


@pytest.mark.slow("three 2-rank trainings of 10 steps")
def test_every_layout_flags_and_skips_the_step_one_rank_does(one_rank, tmp_path):
    want, dump = one_rank
    for name, flags in LAYOUTS.items():
        got = run_trainer(tmp_path / name, 2, [*ARGV, *flags], deadline_s=120)
        assert [s["step"] for s in spikes_of(tmp_path / name / "dump")] == [BAD], name
        for a, b in zip(want, got, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (name, a, b)
            assert a.get("skipped_steps") == b.get("skipped_steps"), (name, a, b)


def test_a_run_resumed_before_a_spike_flags_it_again(one_rank, tmp_path):
    import shutil

    want, dump = one_rank
    at = BAD - 2  # the window (4 steps) is in the checkpoint: steps 3-6
    shutil.copytree(
        dump / "checkpoint" / f"step-{at}", tmp_path / "dump" / "checkpoint" / f"step-{at}"
    )
    got = run_trainer(tmp_path, 1, [*ARGV, "--checkpoint.enable"], deadline_s=120)
    assert [(r["loss"], r["grad_norm"]) for r in got] == [
        (r["loss"], r["grad_norm"]) for r in want[at:]
    ]
    assert spikes_of(tmp_path / "dump") == spikes_of(dump)
