"""How long a checkpoint save blocks training: sync DCP save vs titan's async (process) save.

Trains the model (default: the 1B flavor, fp32, random tokens) in one process on this device
and saves through titan's Checkpointer between steps, exactly as the trainer does: save()
after a step, wait_for_staging() right before the next optimizer step.

Per mode it reports
  blocked      what the training loop waits for: save() plus the wait for the staging copy
               (the copy itself runs while the next forward/backward does)
  slowdown     extra time the steps took, beyond `blocked`, while the save was in flight
               (CPU and memory bandwidth shared with the copy and the writing process)
  save done    from save() until the checkpoint is complete on disk
The first async save also allocates the staging buffers (shared memory, pinned on CUDA) that
later saves reuse; it is reported on its own line. "sync, no checksums" saves with DCP's plain
writer: its difference to "sync" is what checksumming the files as they are written costs.

    python benchmarks/checkpoint_save.py [--flavor 1B] [--optimizer sgd] [--saves 2]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import titan.components.checkpoint.checkpointer as checkpointer  # noqa: E402
import titan.components.checkpoint.integrity as checkpoint_integrity  # noqa: E402
import titan.components.optim.builtin  # noqa: E402, F401  (registers AdamW)
from titan.components.checkpoint.checkpointer import Checkpointer, local_state_bytes  # noqa: E402
from titan.components.checkpoint.train_state import ModelState, TrainState  # noqa: E402
from titan.components.optim.optimizer import build_optimizer  # noqa: E402
from titan.components.optim.optimizer_spec import Optimizer  # noqa: E402
from titan.models.llama3 import LLAMA3_FLAVORS, Transformer  # noqa: E402
from titan.models.llama3.model import rope_cache  # noqa: E402
from titan.runtime.distributed import init_distributed, pick_device  # noqa: E402
from titan.runtime.logging_setup import init_logging  # noqa: E402


class TimedCrc:
    """zlib as the checksumming writer sees it, timing its CRC-32 calls: the part of a sync
    save the checksums cost, apart from the disk's variance."""

    seconds = 0.0

    @classmethod
    def crc32(cls, data, value=0):
        t0 = time.perf_counter()
        value = zlib.crc32(data, value)
        cls.seconds += time.perf_counter() - t0
        return value


class PlainWriter(torch.distributed.checkpoint.FileSystemWriter):
    """DCP's writer as titan's checkpointer calls its own (with an on_write callback)."""

    def __init__(self, path, on_write=None, **kwargs):
        super().__init__(path, **kwargs)


def checkpoint_cfg(mode: str, threads: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        enable=True,
        folder="checkpoint",
        interval=1,
        keep_latest_k=1,
        async_mode=mode,
        last_save_model_only=False,
        export_dtype="float32",
        write_threads=threads,
    )


class Loop:
    def __init__(self, model, opt, batch: int, seq_len: int, vocab: int, device):
        self.model, self.opt = model, opt
        self.tokens = torch.randint(vocab, (batch, seq_len + 1), device=device)
        self.ck: Checkpointer | None = None
        self.staging_wait = 0.0

    def step(self) -> float:
        t0 = time.perf_counter()
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), self.tokens[:, 1:].flatten()).backward()
        if self.ck is not None:
            self.staging_wait += self.ck.wait_for_staging()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def timed_save(loop: Loop, ck: Checkpointer, step: int, base: float) -> tuple[float, float, float]:
    """Save after a step, then train until the save is on disk: (blocked, slowdown, done) s."""
    loop.ck, loop.staging_wait = ck, 0.0
    t0 = time.perf_counter()
    blocked = ck.save(step)
    extra = 0.0
    while ck._pending is not None and not ck._pending[0].done():
        extra += loop.step() - base
    ck.wait()
    done = time.perf_counter() - t0
    blocked += loop.staging_wait
    return blocked, max(0.0, extra - loop.staging_wait), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flavor", default="1B")
    ap.add_argument(
        "--optimizer",
        default="sgd",
        choices=["sgd", "adamw"],
        help="sgd keeps no state (model-only checkpoint); adamw adds 2x the model",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--saves", type=int, default=2, help="timed saves per mode")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    ap.add_argument(
        "--sync-only",
        action="store_true",
        help="only the two sync modes: the checksums' cost, e.g. with --dir "
        "/dev/shm, where no disk's write-back varies the figures",
    )
    ap.add_argument("--write-threads", type=int, default=2, help="checkpoint.write_threads")
    args = ap.parse_args()

    init_logging()  # the checkpointer logs what each save blocked and waited
    device = pick_device()
    init_distributed(device, 1800)
    margs = LLAMA3_FLAVORS[args.flavor].with_updates(max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # values do not matter for speed; seeded init is slow at 1B
        model.rope = rope_cache(margs, device=device)
    states = {"model": ModelState([model]), "train_state": TrainState()}
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)  # stateless
    else:
        opt = states["optimizer"] = build_optimizer(
            [model], Optimizer(lr=1e-6, weight_decay=0.0, implementation="foreach"), {}
        )
    loop = Loop(model, opt, args.batch, args.seq_len, margs.vocab_size, device)

    loop.step()  # warm-up; materializes optimizer state
    base = statistics.median(loop.step() for _ in range(3))
    gib = local_state_bytes({k: st.state_dict() for k, st in states.items()}) / 2**30

    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        checksumming = checkpointer.ChecksummingWriter
        checkpoint_integrity.zlib = TimedCrc
        modes = [("sync, no checksums", "disabled"), ("sync", "disabled"), ("async", "async")]
        for name, mode in modes[:2] if args.sync_only else modes:
            checkpointer.ChecksummingWriter = (
                PlainWriter if "no checksums" in name else checksumming
            )
            ck = Checkpointer(
                checkpoint_cfg(mode, args.write_threads),
                dump_folder=os.path.join(tmp, mode),
                states=states,
                rank=0,
            )
            if mode == "async":
                loop.step()
                rows.append(("async, first save", *timed_save(loop, ck, 0, base)))
            timed = []
            TimedCrc.seconds = 0.0
            for i in range(1, args.saves + 1):
                loop.step()
                timed.append(timed_save(loop, ck, i, base))
            ck.close()
            rows.append((name, *(statistics.fmean(col) for col in zip(*timed))))
            if name == "sync":
                crc_s = TimedCrc.seconds / args.saves
        checkpointer.ChecksummingWriter = checksumming

    what = "model + AdamW" if args.optimizer == "adamw" else "model"
    print(
        f"\n{args.flavor} ({margs.num_params() / 1e9:.2f}B params), {gib:.1f} GiB of state "
        f"({what}), device {device}, torch {torch.__version__}, "
        f"step {base:.2f}s (batch {args.batch} x seq {args.seq_len})"
    )
    print(f"{'mode':<20} {'blocked s':>10} {'slowdown s':>11} {'save done s':>12}")
    for mode, b, slow, done in rows:
        print(f"{mode:<20} {b:>10.2f} {slow:>11.2f} {done:>12.2f}")
    plain_b, sync_b, async_b = rows[0][1], rows[1][1], rows[-1][1]
    print(
        f"checksums add {sync_b - plain_b:+.2f}s to a sync save "
        f"({100 * (sync_b - plain_b) / plain_b:+.1f}%), of which CRC-32 itself {crc_s:.2f}s "
        f"({100 * crc_s / sync_b:.1f}% of the sync save)"
    )
    if not args.sync_only:
        print(f"async blocks training {100 * async_b / sync_b:.1f}% of a sync save (target < 10%)")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
