"""A callback: a running average of the loss, one JSON line per step in the dump folder, with
its own [loss_ema] section; its state is in the checkpoints, so a resumed run continues it."""

import json
import os
from dataclasses import dataclass

from titan.components.training.callbacks import Callback, CallbackSpec
from titan.config.extensions import register
from titan.config.job_config import opt


@dataclass
class LossEmaOptions:
    enable: bool = opt(False, "Write an exponential moving average of the loss every step")
    beta: float = opt(0.9, "Weight of the average so far (1 - beta: the new loss's)")
    file: str = opt("loss_ema.jsonl", "JSON-lines file, in the dump folder")


class LossEma(Callback):
    def __init__(self, options, path: str, rank: int):
        self.beta, self.path, self.rank = options.beta, path, rank
        self.ema, self.steps = 0.0, 0

    def on_train_start(self, run):
        # a resumed run keeps the lines up to its checkpoint's step
        if self.rank == 0:
            lines = []
            if os.path.exists(self.path):
                with open(self.path) as f:
                    lines = [x for x in f if json.loads(x)["step"] <= run.step]
            with open(self.path, "w") as f:
                f.writelines(lines)

    def on_step_end(self, run, end):
        b = self.beta
        self.ema = end.loss if self.steps == 0 else b * self.ema + (1 - b) * end.loss
        self.steps += 1
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": end.step, "loss_ema": self.ema}) + "\n")

    def state_dict(self):
        import torch

        return {
            "ema": torch.tensor(self.ema, dtype=torch.float64),
            "steps": torch.tensor(self.steps),
        }

    def load_state_dict(self, state):
        self.ema, self.steps = float(state["ema"]), int(state["steps"])


def build(run, options):
    if not options.enable:
        return None
    return LossEma(options, os.path.join(run.dump_folder, options.file), run.rank)


def _check(job):
    from titan.config import ConfigError

    beta = job.extensions["loss_ema"].beta
    if not 0 <= beta < 1:
        raise ConfigError(f"loss_ema.beta = {beta}: give a value in [0, 1)")


SPEC = CallbackSpec(
    "loss_ema", build=f"{__name__}:build", check=_check, section="loss_ema", options=LossEmaOptions
)
register(SPEC)
