"""Multi-process tests without torchrun: ranks forked from the already-imported test process.

Forking is cheap (no torch re-import): each rank uses one thread and a gloo group initialized
through a file:// store. `run_workers` joins the ranks against a deadline and fails, killing
them, if they hang; a rank's exception is reported with its traceback.
"""

import datetime
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import workers

DEADLINE_S = 60


def _worker(fn, rank, world_size, init_method, out_dir, args, init_pg, barrier, threads):
    code, result = 1, None
    try:
        torch.set_num_threads(threads)
        if init_pg:
            dist.init_process_group(
                "gloo",
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=30),
            )
        result = fn(rank, world_size, *args)
        if barrier and dist.is_initialized():
            dist.barrier()
        code = 0
    except BaseException:  # noqa: BLE001  reported to the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # gloo's threads can abort a normally exiting interpreter: tear down, flush, _exit
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_workers(
    fn, world_size, tmp_path, *args, deadline_s=DEADLINE_S, init_pg=True, barrier=True, threads=1
):
    """Run fn(rank, world_size, *args) on forked ranks; return the per-rank results.

    With `init_pg=False` the ranks start without a process group (fn makes its own, e.g. a
    Trainer from the RANK/WORLD_SIZE/MASTER_* environment). `barrier=False` skips the closing
    barrier, for tests that break the group on purpose. `threads`: torch threads per rank
    (another count changes the reduction order of CPU kernels)."""
    # more than one thread: spawned, as OpenMP's thread pool does not survive a fork (a forked
    # child that uses two threads hangs once the parent has used its pool); ~4 s more a rank
    ctx = mp.get_context("fork" if threads == 1 else "spawn")
    init = f"file://{tmp_path}/pg_store"
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, init, str(tmp_path), args, init_pg, barrier, threads),
        )
        for r in range(world_size)
    ]
    with workers.busy(world_size * threads):
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        while any(p.is_alive() for p in procs):
            # one failed rank leaves the others blocked in a collective: stop them at once
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                for p in procs:
                    p.join()
                if not failed:
                    pytest.fail(f"workers still running after {deadline_s} s (hang)")
                break
            time.sleep(0.02)
    results, errors = [], []
    for r, p in enumerate(procs):
        path = tmp_path / f"rank{r}.pt"
        res = torch.load(path, weights_only=False) if path.exists() else None
        if isinstance(res, dict) and "error" in res:
            errors.append(f"rank {r}:\n{res['error']}")
        elif p.exitcode != 0 or res is None:
            errors.append(f"rank {r}: exit code {p.exitcode}, no result")
        results.append(res)
    if errors:  # all ranks: the first one listed may only report a peer's crash
        pytest.fail("\n".join(errors))
    return results


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the three 2-rank layouts a feature's layout test trains on beside one rank
TWO_RANK_LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}


def tiny_run(steps: int, warmup: int = 2) -> list[str]:
    """Overrides for a short, deterministic fp32 run of the debug model (seq 32, global batch
    8 in microbatches of 4) that logs every step."""
    return [
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "8",
        "--training.mixed_precision_param",
        "float32",
        "--training.deterministic",
        "--lr_scheduler.warmup_steps",
        str(warmup),
        "--metrics.log_freq",
        "1",
        "--metrics.no_enable_tensorboard",
        "--metrics.peak_flops",
        "1e12",
    ]


def torchrun_env(rank: int, world_size: int, port: int) -> None:
    """The environment torchrun gives a rank of one node, for code that reads it."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def build_trainer(rank, world_size, port, argv):
    """A Trainer on this forked rank, its process group made from the environment torchrun
    would set."""
    from titan.config import parse_args
    from titan.plan.run_plan import plan_run
    from titan.trainer.train import Trainer

    torchrun_env(rank, world_size, port)
    job = parse_args(argv)
    return Trainer(job, plan_run(job, world_size))


def _trainer_rank(rank, world_size, port, argv, log_dir):
    from titan.runtime.logging_setup import init_logging
    from titan.tools.loss_compare import read_metrics

    # each rank's console in a file, formatted as a launched rank's (tests read rank 0's)
    sys.stdout = sys.stderr = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
    os.environ["RANK"] = str(rank)
    init_logging()
    trainer = build_trainer(rank, world_size, port, argv)
    job = trainer.job
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_metrics(job.job.dump_folder) if rank == 0 else []


def run_trainer(
    tmp_path, world_size, argv, deadline_s=DEADLINE_S, threads=1, dump=None
) -> list[dict]:
    """The real Trainer on `world_size` forked ranks (no torchrun, no re-import): a cheap way
    to train models registered in the test process; returns rank 0's metrics records. Each
    rank's console is in `tmp_path/rank<r>.log` (`rank_logs`); `dump`: the dump folder, by
    default `tmp_path/dump`."""
    dump = tmp_path / "dump" if dump is None else dump
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = [*argv, "--job.dump_folder", str(dump)]
    return run_workers(
        _trainer_rank,
        world_size,
        tmp_path,
        free_port(),
        argv,
        str(tmp_path),
        deadline_s=deadline_s,
        init_pg=False,
        threads=threads,
    )[0]


def rank_logs(tmp_path, world_size) -> str:
    """The consoles of `run_trainer`'s ranks, rank 0's first."""
    return "".join((tmp_path / f"rank{r}.log").read_text() for r in range(world_size))


def built_model(spec, args, seed: int = 0, eval: bool = True):
    """The model of a family's `spec` from `args` on the CPU, initialized as a run does with
    `seed` (in eval mode unless `eval` is False)."""
    model = spec.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.eval() if eval else model
