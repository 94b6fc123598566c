"""Callbacks: the trainer's events in order, the figures a callback adds to a logged step, a
callback's stop and save requests, its state in checkpoints (a resumed run continues it bit
for bit), and titan's own (validation) on the same seam."""

import json
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.example_plugin import registered
from tests.forked import run_trainer, tiny_run
from titan.components.training.callbacks import (
    Callback,
    CallbackSpec,
    register_callback,
    unregister_callback,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

CK = ["--checkpoint.enable", "--checkpoint.interval", "2"]


class Recorder(Callback):
    """Writes every event it gets (rank 0); asks for a save and a stop where told to."""

    def __init__(self, path, save_at, stop_at):
        self.path, self.save_at, self.stop_at = path, save_at, stop_at

    def _write(self, run, *event):
        if run.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")

    def on_train_start(self, run):
        self._write(run, "train_start", run.step)

    def on_step_end(self, run, end):
        self._write(run, "step_end", end.step, end.loss, end.logged is not None)
        if end.step == self.save_at:
            run.request_save()
        if end.step == self.stop_at:
            run.request_stop("the recorder says so")

    def figures(self, run, step):
        return {"recorder_step": step, "recorder_lr": run.lr_scheduler.get_last_lr()[0]}

    def on_validation_end(self, run, step, loss, batches):
        self._write(run, "validation_end", step, loss, batches)

    def on_checkpoint_saved(self, run, step, path):
        self._write(run, "checkpoint_saved", step, Path(path).name)

    def on_train_end(self, run):
        self._write(run, "train_end", run.step)


def build_recorder(run, options):
    save_at, stop_at = (int(x) for x in run.job.job.description.split(","))
    return Recorder(Path(run.dump_folder) / "events.jsonl", save_at, stop_at)


@pytest.fixture
def recorder():
    register_callback(CallbackSpec("recorder", build=f"{__name__}:build_recorder"))
    yield
    unregister_callback("recorder")


@pytest.fixture
def loss_ema():
    with registered("loss_ema.py", "loss_ema", register_callback, unregister_callback) as m:
        yield m


def events(dump) -> list:
    return [json.loads(x) for x in (dump / "events.jsonl").read_text().splitlines()]


def test_events_in_order_and_requests_to_save_and_stop(recorder, tmp_path):
    valid = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "1"]
    argv = [*tiny_run(6), *CK, "--checkpoint.interval", "10", *valid, "--job.description", "1,3"]
    records = run_trainer(tmp_path, 2, argv)
    dump = tmp_path / "dump"
    assert [r["step"] for r in records] == [1, 2, 3]  # stopped at 3, not at 6
    # what a callback adds to a logged step's record reaches the writers (metrics.jsonl)
    assert [r["recorder_step"] for r in records] == [1, 2, 3]
    assert all(r["recorder_lr"] > 0 and "gc_s" in r for r in records)
    (val,) = [json.loads(x) for x in (dump / "validation.jsonl").read_text().splitlines()]
    assert events(dump) == [
        ["train_start", 0],
        ["step_end", 1, records[0]["loss"], True],
        ["checkpoint_saved", 1, "step-1"],  # asked for: the interval is 10
        # titan's own callbacks come first: validation ran in its step end, before this one
        ["validation_end", 2, val["val_loss"], 1],
        ["step_end", 2, records[1]["loss"], True],
        ["step_end", 3, records[2]["loss"], True],
        ["checkpoint_saved", 3, "step-3"],  # the stop saves
        ["train_end", 3],
    ]
    assert "stopping after step 3 (the recorder says so)" in (tmp_path / "rank0.log").read_text()
    # the stop's checkpoint resumes: the run goes on to its end
    again = run_trainer(tmp_path, 2, [*argv[:-2], "--job.description", "0,0"])
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]


def test_a_callbacks_state_resumes_bit_for_bit(loss_ema, tmp_path):
    argv = [*tiny_run(4), *CK, "--loss_ema.enable", "--loss_ema.beta", "0.5"]
    straight = run_trainer(tmp_path / "straight", 2, argv)
    run_trainer(tmp_path / "resumed", 2, [*argv, "--training.exit_at_step", "2"])
    step2 = tmp_path / "resumed" / "dump" / "checkpoint" / "step-2"
    md = FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    assert {"train_state.callbacks.loss_ema.ema", "train_state.callbacks.loss_ema.steps"} <= set(md)
    run_trainer(tmp_path / "resumed", 2, argv)

    def ema(name):
        path = tmp_path / name / "dump" / "loss_ema.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]

    assert ema("resumed") == ema("straight")  # steps 1-2, then 3-4 of the resumed run
    expected, average = [], None
    for r in straight:
        average = r["loss"] if average is None else 0.5 * average + 0.5 * r["loss"]
        expected.append({"step": r["step"], "loss_ema": average})
    assert ema("straight") == expected

    # a checkpoint saved without the callback: it starts fresh, and says so
    run_trainer(tmp_path / "late", 1, [*argv[:-3], "--training.exit_at_step", "2"])
    run_trainer(tmp_path / "late", 1, argv)
    assert "holds no state of callback loss_ema" in (tmp_path / "late" / "rank0.log").read_text()
    assert [e["step"] for e in ema("late")] == [3, 4]


def test_a_callbacks_section_is_checked_before_launch(loss_ema):
    from titan.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=r"loss_ema.beta = 1.5: give a value in \[0, 1\)"):
        parse_args(["--loss_ema.beta", "1.5"])


def test_a_stop_reaches_every_callback_even_past_a_failing_one(caplog):
    from titan.components.training.callbacks import Callbacks

    seen = []

    class Breaks(Callback):
        def on_stop(self, run, error):
            raise RuntimeError("callback bug")

    class Notes(Callback):
        def on_stop(self, run, error):
            seen.append((run, str(error)))

    callbacks = Callbacks({"breaks": Breaks(), "notes": Notes()})
    callbacks.stopping("view", KeyboardInterrupt("ctrl-c"))
    assert seen == [("view", "ctrl-c")]
    assert "callback Breaks failed in on_stop" in caplog.text


class FiguresFromTheProse(Callback):
    """`figures(self, run)`, as a reader of a doc without signatures might write it."""

    def figures(self, run):
        return {"mine": 1.0}


def build_from_the_prose(run, options):
    return FiguresFromTheProse()


def test_a_method_the_trainer_cannot_call_is_refused_before_any_step(tmp_path):
    register_callback(CallbackSpec("prose", build=f"{__name__}:build_from_the_prose"))
    try:
        with pytest.raises(pytest.fail.Exception) as e:
            run_trainer(tmp_path, 1, tiny_run(2))
    finally:
        unregister_callback("prose")
    assert (
        "ConfigError: callback 'prose': FiguresFromTheProse.figures(self, run) cannot take what "
        "the trainer passes: figures(self, run, step)" in str(e.value)
    )
    assert not (tmp_path / "dump" / "metrics.jsonl").exists()  # no step was taken


def test_titans_own_callbacks_take_what_the_trainer_passes():
    from titan.components.training.callbacks import _CALLBACKS, signature_problem
    from titan.config import extensions

    extensions.sections()  # loads titan's own registrations
    for spec in _CALLBACKS.entries.values():
        extensions.load(spec.build)  # imports the module that defines the callback

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    own = [c for c in subclasses(Callback) if c.__module__.startswith("titan.")]
    assert len(own) >= 8
    assert [c.__name__ for c in own if signature_problem(c.__new__(c))] == []
