"""The order in which packed windows are trained on: one global stream, sliced per dp rank.

The run's global batch b holds stream positions origin + b x G .. origin + (b + 1) x G - 1
(G = global batch size; origin: 0, or where a resumed checkpoint's run stopped, which may have
had another G); dp rank r takes the r-th contiguous slice of every global batch, as Megatron's
pretraining sampler does, so every optimizer step sees the same sequences whatever the dp
degree, and a run resumed onto another global batch size neither skips nor repeats one.

With several sources, the source of each position is chosen as Megatron's blending does: the
one furthest behind its weight (largest w_s * (g + 1) - count_s, lowest index on ties), which
keeps every prefix of the stream within one sample per source of the weights. Source s's k-th
sample is window perm_{s,epoch}(k mod n_s) of that source: a seeded bijection per epoch that
needs no memory (a Feistel network), so a corpus of any size shuffles in constant space.
"""

import logging

import numpy as np
from torch.utils.data import Sampler

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


class WindowPermutation:
    """A seeded permutation of range(n), evaluated one index at a time: a 4-round Feistel
    network on the smallest even-width bit block holding n, walked until it lands in range."""

    def __init__(self, n: int, seed: int):
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix64(seed * 4 + r + 1) for r in range(4)]

    def _round(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        x = self._round(i)
        while x >= self.n:  # cycle-walking keeps it a bijection on range(n)
            x = self._round(x)
        return x


class GlobalOrder(Sampler):
    """Yields (source, window) for this dp rank's samples, from sample `start` on.

    `sizes`: windows per source; `weights`: their mixing weights (any positive scale).
    Finite (validation, one source): one pass over the whole global batches."""

    def __init__(
        self,
        sizes: list[int],
        weights: list[float],
        *,
        dp_rank: int,
        dp_world_size: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool,
        infinite: bool = True,
        names: list[str] | None = None,
    ):
        self.sizes = list(sizes)
        total = float(sum(weights))
        self.weights = np.asarray(weights, dtype=np.float64) / total
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.global_batch_size = global_batch_size
        self.pieces = 1  # samples a window is cut into (a shorter sequence length)
        self.per_rank = global_batch_size // dp_world_size
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        self.names = names or [f"source{i}" for i in range(len(sizes))]
        if not infinite and len(sizes) != 1:
            raise ValueError("a finite pass is over one source")
        self.start = 0
        self.origin = 0  # stream position of global batch 0 (the resumed run's stop)
        self._counts = {0: np.zeros(len(sizes), dtype=np.int64)}  # global batch -> counts
        self._perms: dict[int, tuple[int, WindowPermutation]] = {}  # source -> its epoch's

    # ---------------------------------------------------------------- the global stream

    def start_at(self, position: int, counts: list[int] | None) -> None:
        """Global batch 0 starts at stream `position`, where the sources had given `counts`
        samples (None: one source, all `position` of them)."""
        self.origin = position
        self._counts = {0: np.asarray(counts if counts is not None else [position], dtype=np.int64)}

    def resize(self, global_batch_size: int, pieces: int = 1) -> None:
        """Global batches of `global_batch_size` windows from batch 0 on, each window cut into
        `pieces` consecutive samples (call start_at next)."""
        self.global_batch_size, self.pieces = global_batch_size, pieces
        self.per_rank = global_batch_size * pieces // self.dp_world_size

    def _sources_of_batch(self, b: int) -> np.ndarray:
        """The source of every position of global batch b, from the counts at its start."""
        counts = self.counts_at(b).copy()
        out = np.empty(self.global_batch_size, dtype=np.int64)
        if len(self.sizes) == 1:
            out[:] = 0
            return out
        g0 = self.origin + b * self.global_batch_size
        for i in range(self.global_batch_size):
            s = int(np.argmax(self.weights * (g0 + i + 1) - counts))
            out[i] = s
            counts[s] += 1
        return out

    def counts_at(self, b: int) -> np.ndarray:
        """Samples drawn from each source before global batch b (the same on every rank)."""
        if b not in self._counts:
            known = max(k for k in self._counts if k <= b)
            counts = self._counts[known]
            for k in range(known, b):
                counts = counts + np.bincount(self._sources_of_batch(k), minlength=len(self.sizes))
                self._counts[k + 1] = counts
            for k in [k for k in self._counts if 0 < k < b - 8]:
                del self._counts[k]  # keep the cache small on long runs
        return self._counts[b]

    def _window(self, s: int, k: int) -> int:
        n = self.sizes[s]
        epoch, pos = divmod(k, n)
        if not self.shuffle:
            return pos
        if self._perms.get(s, (None,))[0] != epoch:
            self._perms[s] = (epoch, WindowPermutation(n, self.seed * 1_000_003 + epoch * 7919 + s))
        return self._perms[s][1][pos]

    def _draws_of_batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of every position of global batch b: k counts the samples its source
        gave before it, in earlier batches and earlier in this one."""
        sources = self._sources_of_batch(b)
        ranks = np.empty_like(sources)
        seen = self.counts_at(b).copy()
        for p, s in enumerate(sources):
            ranks[p] = seen[s]
            seen[s] += 1
        return sources, ranks

    def batch_windows(self, b: int) -> list[tuple[int, int]]:
        """(source, window) of every position of global batch b (all ranks' samples)."""
        sources, ranks = self._draws_of_batch(b)
        return [(int(s), self._window(int(s), int(k))) for s, k in zip(sources, ranks)]

    # ---------------------------------------------------------------- this rank's samples

    def end(self) -> int | None:
        """This rank's sample count of a finite pass (whole global batches only)."""
        if self.infinite:
            return None
        return self.sizes[0] // self.global_batch_size * self.per_rank

    def __iter__(self):
        """(source, window), or with pieces (source, window, piece, pieces): the r-th
        contiguous slice of each global batch's samples, a window's pieces in a row."""
        j, end, n = self.start, self.end(), self.pieces
        batch, sources, ranks = -1, None, None
        while end is None or j < end:
            b, within = divmod(j, self.per_rank)
            i, piece = divmod(self.dp_rank * self.per_rank + within, n)
            if b != batch:
                batch, (sources, ranks) = b, self._draws_of_batch(b)
            s, k = int(sources[i]), int(ranks[i])
            if k and k % self.sizes[s] == 0 and piece == 0:  # a new epoch of source s
                logger.info(
                    "%s: all %d sequences seen, starting epoch %d",
                    self.names[s],
                    self.sizes[s],
                    k // self.sizes[s],
                )
            yield (s, self._window(s, k)) if n == 1 else (s, self._window(s, k), piece, n)
            j += 1

    def __len__(self) -> int:
        end = self.end()
        return (end - self.start) if end is not None else 2**62
