"""Per-rank step times and stragglers, from the metrics section.

In synchronous training every rank's wall-clock step is the same: a slow rank makes the
others wait inside collectives, so what tells the ranks apart is the waiting. torch's flight
recorder (gloo and NCCL alike) stamps each collective when this rank issues it. The latest
stamp of a collective over the ranks is when the last of them arrived, and a rank's wait is
the sum, over the collectives of a training step, of (latest - its own). Its own step time
is its wall time less that wait: a straggler's is the largest, the others' are what they
computed. Each log step measures its own step (the last of the window): the recorder's
buffer (torch's default, 2000 collectives) then needs to hold one step's collectives, and
reading it costs milliseconds, not the seconds of a window's worth (the buffer is set before
the process group is made: flight_recorder.configure_flight_recorder).

Each log step costs two collectives: an all-reduce (max) of the step's stamps, hashed by
(process group, sequence number) into a fixed table of 16384 slots (128 KiB), and an
all-gather of three numbers per rank. Stamps are wall-clock: across hosts, their clocks'
offsets (NTP: about a millisecond) enter each wait. Point-to-point sends (pipelining) are
not counted. NCCL stamps a collective when the host issues it: a slow GPU, as opposed to a
slow host, shows only where the host waits for it before the next issue.
"""

import logging
import pickle
import socket
import statistics

import torch
import torch.distributed as dist

from titan.components.training.callbacks import Callback

logger = logging.getLogger(__name__)

SLOTS = 1 << 14


class RankTimes(Callback):
    """`cfg` is the metrics section. `gather` is a collective: every rank calls it (at every
    logged step, for the last step trained: `figures`)."""

    def __init__(self, cfg, *, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.threshold, self.patience = cfg.straggler_threshold, cfg.straggler_log_steps
        self.streak = [0] * world_size
        hosts = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        self.hosts = hosts

    @classmethod
    def build(cls, cfg, *, rank: int, world_size: int) -> "RankTimes | None":
        return (
            cls(cfg, rank=rank, world_size=world_size) if cfg.per_rank and world_size > 1 else None
        )

    def figures(self, run, step: int) -> dict:
        times = run.metrics.last_step_times()
        return self.gather(*times) if times is not None else {}

    def _stamps(self, start_ns: int, end_ns: int) -> list[tuple[int, int]]:
        """(slot, issue time in ns) of the collectives issued between start and end."""
        dump = pickle.loads(
            torch._C._distributed_c10d._dump_fr_trace(
                includeCollectives=True, includeStackTraces=False, onlyActive=False
            )
        )
        out = []
        for e in dump.get("entries", []):
            if not e["is_p2p"] and start_ns <= e["time_created_ns"] <= end_ns:
                t = e.get("time_discovered_started_ns") or e["time_created_ns"]
                out.append(((e["pg_id"] * 1_000_003 + e["collective_seq_id"]) % SLOTS, t))
        return out

    def gather(self, start_ns: int, end_ns: int, data_s: float) -> dict:
        """For the step that ran from start to end (wall ns) with `data_s` waiting for data,
        what its record gets: the slowest rank by its own step time, that time, the median
        and the spread (seconds), and the largest data wait."""
        stamps = self._stamps(start_ns, end_ns)
        latest = torch.zeros(SLOTS, dtype=torch.int64)
        for slot, t in stamps:
            latest[slot] = max(int(latest[slot]), t)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        waited = sum(max(int(latest[slot]) - t, 0) for slot, t in stamps) / 1e9
        elapsed = (end_ns - start_ns) / 1e9
        mine = torch.tensor([max(elapsed - waited, 0.0), data_s, waited], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        own = [float(v[0]) for v in every]
        slowest = max(range(self.world_size), key=own.__getitem__)
        median = statistics.median(own)
        record = {
            "slowest_rank": slowest,
            "slowest_rank_step_time_s": own[slowest],
            "median_rank_step_time_s": median,
            "rank_step_time_spread_s": own[slowest] - min(own),
            "data_wait_max_s": max(float(v[1]) for v in every),
        }
        for r, t in enumerate(own):
            self.streak[r] = self.streak[r] + 1 if t > (1 + self.threshold) * median else 0
            if self.streak[r] == self.patience:
                record["straggler"] = {"rank": r, "host": self.hosts[r]}
                if self.rank == 0:
                    logger.warning(
                        "straggler: rank %d on %s took %.3fs of its own a step against the "
                        "median's %.3fs (+%.0f%%) for %d log steps; the other ranks wait for it",
                        r,
                        self.hosts[r],
                        t,
                        median,
                        100 * (t / median - 1) if median else 0,
                        self.patience,
                    )
        return record


def build_callback(run, options) -> RankTimes | None:
    return RankTimes.build(run.job.metrics, rank=run.rank, world_size=run.world_size)
