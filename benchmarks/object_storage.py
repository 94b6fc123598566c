"""Checkpoint save and load through titan's checksumming DCP writer: a local folder against an
S3 bucket on a loopback server (moto's server mode, what the tests use), so a regression in the
object-storage path shows beside the disk's figures. moto is a Python server sharing this
machine's cores: its rates bound titan's remote path from below, not a real store's.

    python benchmarks/object_storage.py [--mb 256] [--tensors 16] [--repeats 3]

Prints a table: where, save and load seconds (median), MB/s each way.
Needs the test extra (moto[server], s3fs, universal-pathlib).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from tests.s3_server import s3_server  # noqa: E402
from titan.components.checkpoint.integrity import checksumming_writer  # noqa: E402
from titan.components.checkpoint.storage import as_path, dcp_reader, remove_tree  # noqa: E402


def state(mb: int, tensors: int) -> dict[str, torch.Tensor]:
    n = mb * 2**20 // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(tensors)}


def timed(root: str, sd: dict, repeats: int) -> tuple[float, float]:
    saves, loads = [], []
    for r in range(repeats):
        path = as_path(root) / f"step-{r}"
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=checksumming_writer(path), no_dist=True)
        saves.append(time.perf_counter() - t0)
        back = {k: torch.empty_like(v) for k, v in sd.items()}
        t0 = time.perf_counter()
        dcp.load(back, storage_reader=dcp_reader(path), no_dist=True)
        loads.append(time.perf_counter() - t0)
        assert all(torch.equal(back[k], v) for k, v in sd.items())
        remove_tree(path)
    return statistics.median(saves), statistics.median(loads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sd = state(a.mb, a.tensors)
    rows = []
    with tempfile.TemporaryDirectory() as local:
        rows.append(("local disk", *timed(local, sd, a.repeats)))
    with s3_server("bench"):
        rows.append(("S3, loopback moto", *timed("s3://bench/run", sd, a.repeats)))
    print(f"{a.mb} MiB in {a.tensors} float32 tensors, one process, median of {a.repeats}")
    print(f"{'where':<20}{'save s':>8}{'load s':>8}{'save MB/s':>11}{'load MB/s':>11}")
    mb = a.mb * 2**20 / 1e6
    for where, save, load in rows:
        print(f"{where:<20}{save:>8.2f}{load:>8.2f}{mb / save:>11.0f}{mb / load:>11.0f}")


if __name__ == "__main__":
    main()
