"""muP's learning-rate transfer on CPU: `python benchmarks/mup_transfer.py`.

Sweeps AdamW's lr for the debug model (its 6 layers, 4 heads) at width 64 and width 512, in
titan's standard parametrization and under muP with base width 64 (at width 64 the two are
the same model), a few dozen steps each on the bundled corpus (the same batches for every run),
and prints the validation loss of each (lr, width, parametrization) with each column's best lr.
Under muP the best lr of the width-64 sweep is the best at width 512 too; without it the best
lr moves. benchmarks/RESULTS.md records a run.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan.components.optim.lr_scheduler import lr_factor  # noqa: E402
from titan.tools.coord_check import ROOT, Setup, build, corpus_tokens  # noqa: E402

VALID = ROOT / "assets" / "corpus" / "kjv_valid.jsonl"


def windows(ids: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq_len - 1, (n,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def train(setup: Setup, width: int, base_width, data, valid, steps: int, warmup: int) -> float:
    """The validation loss after `steps` steps (warmup, then linear decay to 10%)."""
    model, opt = build(setup, width, base_width)
    peaks = [g["lr"] for g in opt.param_groups]
    for step, batch in enumerate(data[:steps], start=1):
        f = lr_factor(step, steps, warmup, None, "linear", 0.1)
        for g, peak in zip(opt.param_groups, peaks, strict=True):
            g["lr"] = peak * f
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        if not math.isfinite(loss.item()):
            return math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()).item()
            for b in valid
        ]
    return sum(losses) / len(losses)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--widths", default="64,512")
    p.add_argument("--base_width", type=int, default=64)
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2,1e-1")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--n_layers", type=int, default=6)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the losses here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    widths = [int(w) for w in a.widths.split(",")]
    lrs = [float(x) for x in a.lrs.split(",")]
    gen = torch.Generator().manual_seed(0)
    train_ids = corpus_tokens(400_000, ROOT / "assets" / "corpus" / "kjv_train.jsonl")
    data = [windows(train_ids, a.batch_size, a.seq_len, gen) for _ in range(a.steps)]
    valid_ids = corpus_tokens(100_000, VALID)
    valid = [windows(valid_ids, a.batch_size, a.seq_len, gen) for _ in range(4)]
    columns = [("standard", w) for w in widths] + [("mup", w) for w in widths if w != a.base_width]
    losses: dict = {}
    t0 = time.time()
    for lr in lrs:
        for mode, w in columns:
            setup = Setup(
                n_layers=a.n_layers, n_heads=a.n_heads, seq_len=a.seq_len, lr=lr, weight_decay=0.1
            )
            base = a.base_width if mode == "mup" else None
            losses[(mode, w, lr)] = train(setup, w, base, data, valid, a.steps, a.warmup)
            print(
                f"  {mode} width {w} lr {lr:g}: {losses[(mode, w, lr)]:.4f} "
                f"({time.time() - t0:.0f} s)",
                file=sys.stderr,
            )
    names = [f"{m} {w}" if w != a.base_width else f"{w} (both)" for m, w in columns]
    print("validation loss after", a.steps, "steps (AdamW; muP base width", a.base_width, ")")
    print(f"{'lr':>8} " + "".join(f"{n:>15}" for n in names))
    for lr in lrs:
        print(f"{lr:8g} " + "".join(f"{losses[(m, w, lr)]:15.4f}" for m, w in columns))
    best = [min(lrs, key=lambda lr: losses[(m, w, lr)]) for m, w in columns]
    print(f"{'best lr':>8} " + "".join(f"{b:15g}" for b in best))
    if a.json:
        rows = [{"mode": m, "width": w, "lr": lr, "loss": v} for (m, w, lr), v in losses.items()]
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
