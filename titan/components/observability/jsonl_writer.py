"""`<dump_folder>/metrics.jsonl` (one object per logged step) and `validation.jsonl`: the
history tools and tests read. A resumed run keeps the records up to its checkpoint's step and
drops what a crashed run logged after it; a new run in a folder that holds another run's
history moves that history aside (`metrics.1.jsonl`, ...) rather than deleting it. The files
are strict JSON: a non-finite figure (a skipped step's loss) is written as null."""

import json
import logging
import math
import os

logger = logging.getLogger(__name__)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _set_aside(path: str) -> str:
    """Rename `path` (metrics.jsonl) to the first free metrics.N.jsonl; returns that name."""
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    os.rename(path, f"{stem}.{n}{ext}")
    return f"{stem}.{n}{ext}"


def _records_until(path: str, keep_until: int) -> tuple[list[str], int]:
    """(the lines of steps up to `keep_until`, how many records come after them); a line
    that is not JSON (a torn last line, what a crash or a full disk leaves) is dropped with a
    warning."""
    kept, later, torn = [], 0, 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                torn += 1
                continue
            if step <= keep_until:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                later += 1
    if torn:
        logger.warning(
            "%s: %d line(s) that are not a step's record (cut short by a crash or a full "
            "disk) dropped",
            path,
            torn,
        )
    return kept, later


def start_history(path: str, resume_step: int | None, branched: bool = False) -> None:
    """Continue the history at `path` from `resume_step` (None: start a new one). `branched`:
    the run went back to `resume_step`, its checkpoints after it set aside as another history;
    the whole file is set aside with them, and the new one keeps its records up to it."""
    if not os.path.exists(path):
        return
    kept, later = _records_until(path, resume_step) if resume_step is not None else ([], 0)
    if resume_step is None or (branched and later):
        moved = _set_aside(path)
        logger.warning(
            "%s held %s: kept as %s (this run %s)",
            path,
            "another history" if branched else "an earlier run's history",
            os.path.basename(moved),
            f"continues from step {resume_step}" if resume_step else "starts a new one",
        )
        if not kept:
            return
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


class JsonlWriter:
    def __init__(self, cfg, options, context):
        self.paths = {
            prefix: os.path.join(context.dump_folder, name)
            for prefix, name in (
                ("train/", "metrics.jsonl"),
                ("validation/", "validation.jsonl"),
                ("eval/", "eval.jsonl"),
            )
        }
        for path in self.paths.values():
            start_history(path, context.resume_step, context.branched)
        self.train = open(self.paths["train/"], "a")

    def scalars(self, step: int, values: dict) -> None:
        train = {k.removeprefix("train/"): v for k, v in values.items() if k.startswith("train/")}
        if train:
            self.train.write(_line({"step": step, **train}))
            self.train.flush()
        val = {
            "val_" + k.removeprefix("validation/"): v
            for k, v in values.items()
            if k.startswith("validation/")
        }
        if val:
            with open(self.paths["validation/"], "a") as f:
                f.write(_line({"step": step, **val}))
        scores = {k.removeprefix("eval/"): v for k, v in values.items() if k.startswith("eval/")}
        if scores:
            with open(self.paths["eval/"], "a") as f:
                f.write(_line({"step": step, **scores}))

    def distribution(self, step: int, name: str, values: list[float]) -> None:
        pass  # histograms are TensorBoard's and W&B's; the JSONL keeps scalars

    def close(self) -> None:
        self.train.close()


def _line(record: dict) -> str:
    return json.dumps({k: _finite(v) for k, v in record.items()}, allow_nan=False) + "\n"
