"""titan's side of the GPU suite: the trainer command for a row, and the torchrun entry it
starts, which is `titan.trainer.train` plus two things the suite needs:

- shapes named `<flavor>_cut<N>` (a published flavor cut to N layers) are added to the
  model registry before the config is checked, so `--model.flavor 8B_cut8` works;
- every checkpoint save and every wait for an async save's staging copy is timed exactly
  (the values Checkpointer returns to the trainer) into <dump_folder>/checkpoint_times.jsonl.

    python -m torch.distributed.run --standalone --nproc_per_node 1 \\
        benchmarks/gpu_suite_titan.py --model.flavor 8B_cut8 [trainer overrides]
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides(row, peak_flops: float, device: str) -> list[str]:
    """Trainer overrides for a train or checkpoint row."""
    out = [
        "--model.name",
        row.model,
        "--model.flavor",
        row.shape,
        "--training.device",
        device,
        "--training.seq_len",
        str(row.seq_len),
        "--training.local_batch_size",
        str(row.batch),
        "--training.steps",
        str(row.steps),
        "--training.mixed_precision_param",
        row.dtype,
        # torchtitan's default learning rate: the debug config's 3e-3 diverges at 8B width
        "--optimizer.lr",
        "8e-4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.no_enable_tensorboard",
        "--metrics.peak_flops",
        f"{peak_flops:.6g}",
        "--activation_checkpoint.mode",
        row.ac,
        # per-op SAC: torchtitan 0.3's only selective mode (every other matmul recomputed)
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    if row.compile:
        out.append("--compile.enable")
    if row.float8:
        # rowwise: the one float8 recipe both titan and torchtitan 0.3 offer
        out += ["--model.converters", "float8", "--float8.recipe_name", "rowwise"]
        if device == "cpu":
            out.append("--float8.emulate")
    if row.checkpoint_mode:
        out += [
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.async_mode",
            row.checkpoint_mode,
            "--checkpoint.keep_latest_k",
            "1",
        ]
    return out


def command(row, dump: Path, peak_flops: float, device: str) -> list[str]:
    # the trainer's own launcher (run_train.sh) runs torchrun the same way, with `python`;
    # sys.executable is the interpreter that holds torch wherever `python` is missing
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node=1",
        "--local-ranks-filter=0",
        "--role=rank",
        "--tee=3",
        str(Path(__file__).resolve()),
        *overrides(row, peak_flops, device),
        "--job.dump_folder",
        str(dump),
    ]


def read_checkpoint_times(dump: Path) -> list[dict]:
    path = Path(dump) / "checkpoint_times.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------- the entry


def _register_cut_flavors(argv: list[str]) -> None:
    from gpu_suite_rows import split_shape

    from titan.models.spec import get_train_spec

    given = dict(zip(argv[:-1], argv[1:]))
    flavors = get_train_spec(given.get("--model.name", "llama3")).flavors
    base, layers = split_shape(given.get("--model.flavor", ""))
    if layers and base in flavors:
        flavors[given["--model.flavor"]] = flavors[base].with_updates(n_layers=layers)


def _time_checkpoints() -> None:
    from titan.components.checkpoint.checkpointer import Checkpointer

    save, wait_for_staging = Checkpointer.save, Checkpointer.wait_for_staging
    staging = {}  # id(checkpointer) -> step of the async save whose copy is not waited for yet

    def log(ck, record):
        if ck.rank == 0:
            with open(ck.root.parent / "checkpoint_times.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def timed_save(self, step, model_only=False, blocking=False):
        # a save first waits for the one before it; real runs save hundreds of steps apart,
        # the suite's a few: finish the previous save untimed, so what is timed is one save
        self.wait()
        blocked = save(self, step, model_only=model_only, blocking=blocking)
        run_async = self.cfg.async_mode != "disabled" and not blocking
        if run_async:
            staging[id(self)] = step
        log(self, {"step": step, "event": "save", "async": run_async, "seconds": blocked})
        return blocked

    def timed_wait(self):
        waited = wait_for_staging(self)
        step = staging.pop(id(self), None)
        if step is not None:
            log(self, {"step": step, "event": "staging_wait", "seconds": waited})
        return waited

    Checkpointer.save, Checkpointer.wait_for_staging = timed_save, timed_wait


def main() -> None:
    argv = sys.argv[1:]
    # torchrun puts this file's folder first on sys.path; titan is found from the repo
    sys.path.insert(1, str(REPO))
    _register_cut_flavors(argv)
    _time_checkpoints()
    from titan.trainer.train import main as train

    train(argv)


if __name__ == "__main__":
    main()
