"""A CPU training step of the MoE debug models under bf16 autocast (fp32 parameters, as a
one-device run computes): the experts through the grouped GEMM (now) against the per-expert
loop they fell back to before the grouped GEMM took autocast, rounds interleaved (grouped,
loop, grouped, ...) so that machine load falls on both alike.

    python benchmarks/moe_step_cpu.py [--rounds 5 --steps 4 --batch 4 --seq-len 256]

Prints per model and path the median step time over rounds (each round's median of --steps
steps after one warm-up) and the ratio.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import titan.models.common.moe as moe_module  # noqa: E402
from titan.models.common.aux_loss import AuxLossCollector  # noqa: E402
from titan.models.spec import get_train_spec  # noqa: E402

MODELS = {
    "Qwen3-MoE debug": ("qwen3", "debugmodel_moe"),
    "DeepSeek-V3 debug": ("deepseek_v3", "debugmodel"),
}


def build(family: str, flavor: str, seq: int):
    spec = get_train_spec(family)
    args = spec.flavors[flavor].with_updates(max_seq_len=seq)
    model = spec.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model.train(), args


def step_times(model, opt, tokens, grouped: bool, steps: int) -> float:
    path = moe_module._grouped_mm_fits if grouped else (lambda x, w: False)
    with mock.patch.object(moe_module, "_grouped_mm_fits", path):
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            with AuxLossCollector(1.0), torch.autocast("cpu", torch.bfloat16):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:  # the first step of a round warms up
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x "
        f"seq {args.seq_len}, bf16 autocast, fp32 parameters, AdamW"
    )
    print("| model | grouped GEMM s/step | per-expert loop s/step | loop / grouped |")
    print("|---|---|---|---|")
    for name, (family, flavor) in MODELS.items():
        model, margs = build(family, flavor, args.seq_len)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        got = {True: [], False: []}
        for _ in range(args.rounds):
            for grouped in (True, False):
                got[grouped].append(step_times(model, opt, tokens, grouped, args.steps))
        g, loop = statistics.median(got[True]), statistics.median(got[False])
        print(f"| {name} | {g:.3f} | {loop:.3f} | {loop / g:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
