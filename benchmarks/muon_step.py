"""Muon's optimizer step against world size: the Newton-Schulz iterations divided among the
ranks (each split matrix on one rank, broadcast from it) against every rank iterating every
matrix, FSDP-sharded matrices of a Llama block's shapes, one torch thread a rank.

    python benchmarks/muon_step.py [--ranks 1 2 4] [--dim 512] [--layers 2] [--steps 3]

Prints a table: ranks, mode, the step's median seconds, the iterations each rank ran. On a
machine with fewer cores than ranks the ranks share cores, and the times say so: the column
of iterations is the cut the division makes, whatever the cores.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    hidden = int(8 * dim / 3) // 64 * 64 or 64
    block = [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim)]  # wq wk wv wo, FFN
    return block * layers


def _rank(rank, world, init, args, divide, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import titan.components.optim.muon as muon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g) * 0.02, mesh, [Shard(0)]))
        for s in shapes(args.dim, args.layers)
    ]
    opt = muon.Muon(
        [{"params": params, "lr": 1e-3, "weight_decay": 0.0, "muon": True}],
        betas=(0.9, 0.95),
        eps=1e-8,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        ns_dtype=torch.float32,
        adjust_lr="match_rms_adamw",
        divide=divide,
    )
    ran = [0]
    plain = muon.newton_schulz

    def counted(x, steps, dtype):
        ran[0] += 1
        return plain(x, steps, dtype)

    muon.newton_schulz = counted
    times = []
    for _ in range(args.steps + 1):  # the first builds the states and groups
        for p in params:
            p.grad = torch.ones_like(p) * 1e-3
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    per_step = ran[0] // (args.steps + 1)
    if rank == 0:
        out.put((statistics.median(times[1:]), per_step))
    dist.destroy_process_group()


def run(world: int, divide: bool, args) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [
            ctx.Process(target=_rank, args=(r, world, init, args, divide, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        result = out.get(timeout=600)
        for p in procs:
            p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    n = len(shapes(args.dim, args.layers))
    print(f"{n} matrices (dim {args.dim}, {args.layers} blocks), {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'mode':>8} {'step s':>8} {'iterations/rank':>16}")
    for world in args.ranks:
        for divide in (False, True):
            seconds, ran = run(world, divide, args)
            mode = "divided" if divide else "every"
            print(f"{world:>5} {mode:>8} {seconds:>8.3f} {ran:>16}", flush=True)


if __name__ == "__main__":
    main()
