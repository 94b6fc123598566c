"""`<dump_folder>/metrics.jsonl` (one object per logged step) and `validation.jsonl`: the
history tools and tests read. A resumed run keeps the records up to its checkpoint's step and
drops what a crashed run logged after it."""

import json
import os


def _truncate_history(path: str, keep_until: int | None) -> None:
    if keep_until is None or not os.path.exists(path):
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path) as f:
        kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= keep_until]
    with open(path, "w") as f:
        f.writelines(kept)


class JsonlWriter:
    def __init__(self, cfg, options, context):
        self.paths = {
            prefix: os.path.join(context.dump_folder, name)
            for prefix, name in (("train/", "metrics.jsonl"), ("validation/", "validation.jsonl"))
        }
        for path in self.paths.values():
            _truncate_history(path, context.resume_step)
        self.train = open(self.paths["train/"], "a")

    def scalars(self, step: int, values: dict) -> None:
        train = {k.removeprefix("train/"): v for k, v in values.items() if k.startswith("train/")}
        if train:
            self.train.write(json.dumps({"step": step, **train}) + "\n")
            self.train.flush()
        val = {
            "val_" + k.removeprefix("validation/"): v
            for k, v in values.items()
            if k.startswith("validation/")
        }
        if val:
            with open(self.paths["validation/"], "a") as f:
                f.write(json.dumps({"step": step, **val}) + "\n")

    def distribution(self, step: int, name: str, values: list[float]) -> None:
        pass  # histograms are TensorBoard's and W&B's; the JSONL keeps scalars

    def close(self) -> None:
        self.train.close()
