"""Does gloo survive two collectives in flight on one process group?

torch's ring-attention backward overlaps its K/V exchange (all-gather or all-to-all) with its
dK/dV exchange (all-to-all) on the cp group. With gloo in torch 2.13 that now and then
corrupts the heap: a rank aborts with "malloc(): unaligned tcache chunk detected". So titan's
CPU context parallelism awaits each exchange before issuing the next
(titan/parallelisms/context_parallel.py). Run this after a torch upgrade to see whether that
is still needed; it fails only now and then, so run it several times:

    torchrun --standalone --nproc_per_node 4 scripts/gloo_overlap_check.py [--serial]

Each iteration sends a cp x tp step's traffic (the ring's two exchanges, sequence parallel's
all-gather and reduce-scatter). A rank killed by SIGABRT or SIGSEGV means the bug is there.
With --serial each collective is awaited before the next one is issued, as titan does.
Figures: benchmarks/RESULTS.md.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--serial", action="store_true", help="await each collective at once")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # the layout where it was first seen: cp x tp, the ring running on the cp groups
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("cp", "tp"))
    cp, tp = mesh["cp"].get_group(), mesh["tp"].get_group()
    t0 = time.perf_counter()
    for i in range(args.iters):
        n = 64 + (i * 37) % 8192  # varying sizes, as the heap churns in training
        pending = []
        # a cp x tp step's traffic: the ring's two exchanges on cp, sequence parallel's on tp
        for issue in (
            lambda n=n: funcol.all_gather_single(torch.randn(n), 0, tp),
            lambda n=n: funcol.all_gather_single(torch.randn(n), 0, cp),
            lambda n=n: funcol.permute_tensor(torch.randn(2 * n), [1, 0], cp),
            lambda n=n: funcol.reduce_scatter_tensor(torch.randn(2 * n), "sum", 0, tp),
        ):
            pending.append(issue())
            if args.serial:
                pending[-1] = pending[-1].wait()
        [torch.empty(k) for k in (3, 17, 100, 255)]  # small allocations meanwhile
        for t in pending:
            (t.wait() if hasattr(t, "wait") else t).sum()
    dist.barrier()
    if dist.get_rank() == 0:
        mode = "serial" if args.serial else "overlapped"
        print(
            f"ok: {args.iters} {mode} iterations on {dist.get_world_size()} ranks in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    sys.stderr.flush()
    # skip interpreter teardown, where gloo's threads can abort a process for other reasons
    os._exit(0)


if __name__ == "__main__":
    main()
