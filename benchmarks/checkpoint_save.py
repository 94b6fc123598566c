"""How long a checkpoint save blocks training: sync DCP save vs titan's async (process) save.

Builds the model (default: the 1B flavor, fp32, model + AdamW state unless --model-only)
in one process on this device, then saves through titan's Checkpointer in each mode:
one warm-up save (the async mode starts its helper process then), then --repeats timed saves.
"Blocked" is what Checkpointer.save returns: the time training waits. Prints a table.

    python benchmarks/checkpoint_save.py [--flavor 1B] [--model-only] [--repeats 2]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titan.components.checkpoint import Checkpointer, ModelState, TrainState  # noqa: E402
from titan.components.lr_scheduler import build_lr_scheduler  # noqa: E402
from titan.components.optimizer import build_optimizer  # noqa: E402
from titan.distributed import init_distributed, pick_device  # noqa: E402
from titan.models.llama3 import LLAMA3_FLAVORS, Transformer  # noqa: E402


def checkpoint_cfg(mode: str) -> SimpleNamespace:
    return SimpleNamespace(enable=True, folder="checkpoint", interval=1, keep_latest_k=1,
                           async_mode=mode, last_save_model_only=False, export_dtype="float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flavor", default="1B")
    ap.add_argument("--model-only", action="store_true", help="skip the optimizer state")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = ap.parse_args()

    device = pick_device()
    init_distributed(device, 600)
    margs = LLAMA3_FLAVORS[args.flavor].with_updates(max_seq_len=128)
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # values do not matter for write speed; seeded init is slow at 1B
    states = {"model": ModelState([model]), "train_state": TrainState()}
    if not args.model_only:
        opt = build_optimizer([model], "AdamW", 1e-4, 0.9, 0.95, 1e-8, 0.0, "foreach")
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # materialize exp_avg / exp_avg_sq
        states["optimizer"] = opt
        states["lr_scheduler"] = build_lr_scheduler(opt, 10, 1, None, "linear", 0.0)
    gib = sum(v.numel() * v.element_size() for st in states.values()
              for v in st.state_dict().values() if isinstance(v, torch.Tensor)) / 2**30

    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mode in ("disabled", "async"):
            ck = Checkpointer(checkpoint_cfg(mode), os.path.join(tmp, mode), states, rank=0)
            blocked, total = [], []
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                b = ck.save(i + 1)
                ck.wait()
                if i:  # the first save warms caches and starts the async helper process
                    blocked.append(b)
                    total.append(time.perf_counter() - t0)
            ck.close()
            rows.append((mode, statistics.fmean(blocked), statistics.fmean(total)))

    print(f"\n{args.flavor} ({margs.num_params() / 1e9:.2f}B params), {gib:.1f} GiB of state "
          f"{'(model only)' if args.model_only else '(model + AdamW)'}, device {device}, "
          f"torch {torch.__version__}")
    print(f"{'mode':<10} {'blocked s':>10} {'save done s':>12}")
    for mode, b, t in rows:
        print(f"{mode:<10} {b:>10.2f} {t:>12.2f}")
    sync_b, async_b = rows[0][1], rows[1][1]
    print(f"async blocks training {100 * async_b / sync_b:.1f}% of a sync save (target < 10%)")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
