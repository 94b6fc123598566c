"""A stopping signal names the step it arrived in, wherever in the unwinding it lands."""

import logging
import os
import signal
import time

import pytest

from titan.components.checkpoint.checkpointer import SaveInterrupted
from titan.components.fault_tolerance import interrupts
from titan.config.job_config import JobConfig
from titan.trainer import train


@pytest.fixture
def handlers(monkeypatch):
    kept = {s: signal.getsignal(s) for s in interrupts.STOPPING}
    monkeypatch.setattr(interrupts, "_received", None)
    monkeypatch.setattr(interrupts, "_step_source", None)
    monkeypatch.setattr(interrupts, "_step_at_signal", 0)
    interrupts.install()
    yield
    for s, h in kept.items():
        signal.signal(s, h)


def _signal_self():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises before this ends


class _SaveFailsThenStopArrivesInClose:
    """A peer died mid-save (step 8) and torchrun's SIGTERM reaches this rank while it closes."""

    step = 8

    def __init__(self, job, plan):
        pass

    def train(self):
        raise SaveInterrupted("checkpoint step 8 was not written: peer closed the connection")

    def stopping(self, error):
        pass

    def close(self):
        _signal_self()


def test_a_stop_landing_in_cleanup_still_names_its_step(handlers, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(train, "Trainer", _SaveFailsThenStopArrivesInClose)
    monkeypatch.setattr(train, "stop_save_process", lambda kill: None)
    job = JobConfig()
    job.job.dump_folder = str(tmp_path)
    with pytest.raises(interrupts.Interrupted) as stop:
        train.run.__wrapped__(job, None)
    assert not hasattr(stop.value, "step")  # the exception itself could not carry it
    with caplog.at_level(logging.WARNING):
        code = train._report(stop.value, job)
    assert code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM during step 8" in caplog.text, caplog.text


def test_a_stop_before_the_trainer_exists_says_so(handlers, tmp_path, caplog):
    job = JobConfig()
    job.job.dump_folder = str(tmp_path)
    with pytest.raises(interrupts.Interrupted) as stop:
        _signal_self()
    with caplog.at_level(logging.WARNING):
        train._report(stop.value, job)
    assert "stopped by SIGTERM before the first step" in caplog.text, caplog.text
