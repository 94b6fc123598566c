"""Training metrics: each logged step's record (loss, throughput, MFU, memory, and what the
callbacks add: GC seconds, per-rank step times) and its line on the console. The record goes
to the run's metrics writers (metrics.jsonl, which tools and tests read, TensorBoard, W&B, any
registered one) through their callback, titan.components.observability.writers.
"""

import logging
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

_COLORS = {
    "step": "\033[36m",
    "loss": "\033[32m",
    "mem": "\033[33m",
    "tps": "\033[34m",
    "mfu": "\033[35m",
    "reset": "\033[0m",
}


def memory_gib(device: torch.device) -> dict[str, float]:
    """Peak memory: on CUDA since the last call (the caching allocator's peaks are reset
    here); on CPU the process's resident-set high-water mark since it started."""
    if device.type == "cuda":
        stats = {
            "memory_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "memory_active_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    # ru_maxrss is in KiB on Linux: the high-water mark of the whole process, which counts
    # the page cache of memory-mapped token shards as it is read; the anonymous part is what
    # the process itself holds
    stats = {"memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    anon = _status_kib("RssAnon")
    if anon is not None:
        stats["memory_anon_gib"] = anon / 2**20
    return stats


def on_host(values: dict) -> dict:
    """`values` with each tensor replaced by its number (0-dim) or list of numbers, read from
    the device in one copy: figures measured every step stay on the device until logged."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return values
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors.values()]).tolist()
    out, at = dict(values), 0
    for k, t in tensors.items():
        out[k] = flat[at] if t.dim() == 0 else flat[at : at + t.numel()]
        at += t.numel()
    return out


def _short(value, key: str = "") -> str:
    """A figure on the console: seconds (`*_s`) to the 0.1 ms, every step alike; other
    floats to 4 significant digits."""
    if isinstance(value, float) and key.endswith("_s"):
        return f"{value:.4f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _percent(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:5.2f}%"


def _duration(seconds: float) -> str:
    """1h02m, 3m05s or 42s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class _Window:
    """What happened since the last logged step."""

    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    flops: float = 0.0  # the tokens' training FLOPs
    data_s: float = 0.0
    steps: int = 0
    excluded_s: float = 0.0
    kinds: dict = field(default_factory=dict)  # tokens of each kind that is not text
    last_step: tuple | None = None  # (start ns, end ns, data s) of the newest step


class MetricsLogger:
    """Configured by `cfg` (the metrics section); every rank prints its own line.

    `peak_flops` None leaves MFU out (null in the JSONL, n/a on the console);
    `max_over_ranks(value)` is a collective giving the largest value over all ranks;
    `total_steps` is the run's last step (the line shows `step N/total` and an ETA).
    """

    def __init__(
        self,
        cfg,
        *,
        device: torch.device,
        flops_per_token: float,
        peak_flops: float | None,
        max_over_ranks=None,
        total_steps: int | None = None,
    ):
        self.log_freq = cfg.log_freq
        self.total_steps = total_steps
        self.device = device
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        plain = cfg.disable_color_printing or not sys.stderr.isatty()
        self.color = (lambda k: "") if plain else _COLORS.get
        # every rank must call log(): the cross-rank memory maximum is a collective
        self.max_over_ranks = max_over_ranks
        self.window = _Window()

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == last_step

    def record_step(
        self,
        tokens: int,
        data_s: float,
        started_ns: int | None = None,
        flops_per_token: float | None = None,
        kinds: dict[str, int] | None = None,
    ) -> None:
        """`started_ns`: the step's start (time.time_ns()); it ends now. `flops_per_token`:
        the step's own, where its sequence length is not the run's (a warm-up) or its inputs
        cost more than their tokens (images). `kinds`: how many of the tokens are of each
        kind that is not text (image), logged apart."""
        w = self.window
        if started_ns is not None:
            w.last_step = (started_ns, time.time_ns(), data_s)
        w.tokens += tokens
        for kind, n in (kinds or {}).items():
            w.kinds[kind] = w.kinds.get(kind, 0) + n
        w.flops += tokens * (flops_per_token or self.flops_per_token)
        w.data_s += data_s
        w.steps += 1

    def last_step_times(self) -> tuple[int, int, float] | None:
        """(start ns, end ns, seconds waiting for data) of the newest step recorded."""
        return self.window.last_step

    def log(
        self, step: int, loss: float, grad_norm: float, lr: float, tokens_seen: int, **extra
    ) -> dict:
        """The record of the window ending at `step`, printed; every rank must call it.
        `tokens_seen`: training tokens consumed by all ranks so far. An `extra` value that is
        a list of numbers (an MoE layer's expert loads) is a distribution for the writers,
        not printed; a tensor is read here (`on_host`)."""
        extra = on_host(extra)
        w = self.window
        elapsed = max(time.perf_counter() - w.start - w.excluded_s, 1e-9)
        tps = w.tokens / elapsed
        tflops = w.flops / elapsed / 1e12
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "mfu": None if self.peak_flops is None else 100 * tflops * 1e12 / self.peak_flops,
            **self._memory(),
            "data_pct": 100 * w.data_s / elapsed,
            "step_time_s": elapsed / max(w.steps, 1),
            "tokens_seen": tokens_seen,
            # text and each other kind of token apart (image_tps: an image's tokens a second)
            **(
                {
                    "text_tps": (w.tokens - sum(w.kinds.values())) / elapsed,
                    **{f"{k}_tps": n / elapsed for k, n in w.kinds.items()},
                }
                if w.kinds
                else {}
            ),
            **extra,
        }
        self.window = _Window()
        printed = {k: v for k, v in extra.items() if not isinstance(v, list)}
        # each rank prints its own line (memory differs per rank); LOG_RANK picks what is shown
        c = self.color
        logger.info(
            f"{c('step')}step: {self._progress(step)}  {c('loss')}loss: {loss:8.4f}{c('reset')}  "
            f"grad_norm: {grad_norm:7.4f}  lr: {lr:.2e}  "
            f"{c('mem')}memory: {record['memory_gib']:6.2f}GiB  "
            f"{c('tps')}tps: {tps:>10,.0f}{self._kinds(record)}  tflops: {tflops:7.2f}  "
            f"{c('mfu')}mfu: {_percent(record['mfu'])}{c('reset')}  "
            f"data: {record['data_pct']:4.1f}%"
            + "".join(f"  {k}: {_short(v, k)}" for k, v in printed.items())
            + self._eta(step, record["step_time_s"])
        )
        return record

    @staticmethod
    def _kinds(record: dict) -> str:
        """The tokens/s of text and of each other kind, where a step had another kind."""
        kinds = [k for k in record if k.endswith("_tps") and k != "text_tps"]
        if not kinds:
            return ""
        parts = [f"text {record['text_tps']:,.0f}"] + [
            f"{k[: -len('_tps')]} {record[k]:,.0f}" for k in kinds
        ]
        return f" ({', '.join(parts)})"

    def _progress(self, step: int) -> str:
        if self.total_steps is None:
            return f"{step:>6}"
        return f"{step:>{len(str(self.total_steps))}}/{self.total_steps}"

    def _eta(self, step: int, step_time_s: float) -> str:
        """The time left at the newest window's pace; step 1's window holds the start-up
        (building, compiling, the first loads), so it gives none."""
        if self.total_steps is None or step <= 1 or step >= self.total_steps:
            return ""
        return f"  eta: {_duration((self.total_steps - step) * step_time_s)}"

    def _memory(self) -> dict[str, float]:
        mem = memory_gib(self.device)
        if self.max_over_ranks is not None:
            mem["memory_max_gib"] = self.max_over_ranks(mem["memory_gib"])
        return mem

    def log_validation(self, step: int, loss: float, steps: int, of: str | None = None) -> None:
        """The console's validation line; `of`: what was scored, where not the weights
        training updates (the EMA's average)."""
        scored = f"  ({of})" if of else ""
        logger.info(f"validation  step: {step:>6}  loss: {loss:8.4f}  batches: {steps}{scored}")

    def exclude(self, seconds: float) -> None:
        """Keep time spent outside training steps (validation, checkpoints) out of tokens/s."""
        self.window.excluded_s += seconds


def input_costs(model_args, batches: list) -> tuple[float, dict[str, int]]:
    """(the inputs' FLOPs beyond their tokens', the tokens of each other kind) of a step's
    batches, on the host (the family's ModelArgs.input_costs)."""
    flops, kinds = 0.0, {}
    for batch in batches:
        f, k = model_args.input_costs(batch)
        flops += f
        for kind, n in k.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return flops, kinds
