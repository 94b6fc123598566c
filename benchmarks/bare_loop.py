"""The reference for benchmarks/overhead.py: a hand-written loop with nothing but the work.

Same model class, data, optimizer and schedule as the trainer; no process group, metrics,
GC control, profiler or checkpoint logic. The model is titan's own class, so its attention path
is the trainer's (SDPA sharing each K/V head among its query heads, `enable_gqa`; RoPE as one
complex multiply): the same "bare" as benchmarks/vs_torchtitan.py's runs. Prints one JSON line
with its tokens/s.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from titan.components.data.dataloader import DataShard, build_text_dataloader
from titan.components.data.tokenizer import Tokenizer
from titan.models.llama3 import LLAMA3_FLAVORS, Transformer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    tok = Tokenizer("assets/tokenizer/tokenizer.json")
    margs = LLAMA3_FLAVORS[args.flavor].with_updates(
        vocab_size=tok.vocab_size, max_seq_len=args.seq_len
    )
    loader = build_text_dataloader(
        dataset="kjv",
        dataset_path=None,
        tokenizer=tok,
        seq_len=args.seq_len,
        local_batch_size=args.batch,
        global_batch_size=args.batch,
        shard=DataShard(),
        seed=args.seed,
    )
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    model.init_weights(args.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    it = iter(loader)
    t0 = None
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            t0 = time.perf_counter()
        batch = next(it)
        x, y = batch["input_ids"], batch["labels"]
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        loss.item()  # the trainer reads the loss every step too
    elapsed = time.perf_counter() - t0
    tokens = (args.steps - args.warmup) * args.batch * args.seq_len
    print(json.dumps({"tps": tokens / elapsed, "loss": loss.item()}))


if __name__ == "__main__":
    main()
