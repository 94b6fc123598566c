"""Run training configurations through run_train.sh and compare their metrics step by step.

Used by the integration tests and by `scripts/loss_compare.py`. Each run gets its own dump
folder; numbers come from metrics.jsonl, never from the console. Runs that would train
different global batches (the default global_batch_size grows with the data-parallel ranks)
are refused before any of them starts.
"""

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from titan.runtime.paths import REPO_ROOT


class RunFailed(RuntimeError):
    pass


@dataclass
class Run:
    nproc: int
    overrides: list[str]
    env: dict | None = None

    @classmethod
    def parse(cls, spec: str) -> "Run":
        """'NPROC:--a.b 1 --c.d 2' -> Run."""
        nproc, _, rest = spec.partition(":")
        return cls(int(nproc), shlex.split(rest))

    def label(self) -> str:
        return f"{self.nproc} rank{'s' if self.nproc > 1 else ''} " + " ".join(self.overrides)


def read_metrics(dump_folder: str | Path, name: str = "metrics.jsonl") -> list[dict]:
    """The records of a metrics file; a last line cut short (a run killed mid-write) is left
    out. Raises ValueError naming the line for any other that is not JSON."""
    path = Path(dump_folder) / name
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                break  # the write the run was killed in
            raise ValueError(
                f"{path}, line {n}: not a JSON record ({e.msg}); the file is "
                "damaged: remove the line or the file"
            ) from None
    return records


def command(
    nproc: int,
    overrides: list[str],
    dump_folder: str | Path,
    env: dict | None = None,
    config_file: str | None = None,
) -> tuple[list[str], dict]:
    """The run_train.sh command line and environment for one run."""
    # run_train.sh starts `$PYTHON`: this interpreter, also when its venv is not activated
    full_env = {
        "PYTHON": sys.executable,
        **os.environ,
        "NGPU": str(nproc),
        "LOG_RANK": "0",
        **(env or {}),
    }
    if config_file:
        full_env["CONFIG_FILE"] = config_file
    cmd = [str(REPO_ROOT / "run_train.sh"), *overrides, "--job.dump_folder", str(dump_folder)]
    return cmd, full_env


def find_workers(dump_folder: str | Path, rank: int | None = None) -> list[int]:
    """Pids of the titan processes writing to `dump_folder` (launcher and workers), or only
    the worker with this RANK."""
    needle = str(dump_folder).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if needle not in cmdline or not any(b"titan" in c for c in cmdline):
                continue
            if rank is not None:
                env = dict(
                    kv.split(b"=", 1)
                    for kv in (proc / "environ").read_bytes().split(b"\0")
                    if b"=" in kv
                )
                if b"titan.trainer" not in cmdline or env.get(b"RANK") != str(rank).encode():
                    continue
        except OSError:
            continue
        pids.append(int(proc.name))
    return pids


def kill_workers(dump_folder: str | Path) -> None:
    """SIGKILL every titan process writing to `dump_folder` (torchrun puts workers in their own
    sessions, so killing the launcher alone would orphan them)."""
    for pid in find_workers(dump_folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def rank_tails(log_dir: str | Path, lines: int = 20) -> str:
    """The last `lines` lines each rank wrote to stderr, from torchrun's per-rank log files
    (the console shows only LOG_RANK's ranks; a crash is often on another one)."""
    out = []
    for log in sorted(
        Path(log_dir).glob("*/attempt_*/*/stderr.log"),
        key=lambda p: (p.parent.parent.name, int(p.parent.name)),
    ):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.parent.parent.name}, local rank {log.parent.name} ---")
        out += tail
    return "\n".join(out)


def launch(
    nproc: int,
    overrides: list[str],
    dump_folder: str | Path,
    timeout: float = 600,
    env: dict | None = None,
    config_file: str | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """./run_train.sh with NGPU=nproc; the process group is killed if it outlives `timeout`.
    A failure's message carries every rank's last lines, not only rank 0's."""
    cmd, full_env = command(nproc, overrides, dump_folder, env, config_file)
    with tempfile.TemporaryDirectory(prefix="titan-rank-logs-") as log_dir:
        full_env.setdefault("PET_LOG_DIR", log_dir)  # torchrun's --log-dir
        try:
            proc = subprocess.run(
                cmd,
                env=full_env,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            kill_workers(dump_folder)
            raise RunFailed(
                f"{' '.join(cmd)} (NGPU={nproc}) timed out after {timeout}s; last "
                f"lines of every rank:\n{rank_tails(full_env['PET_LOG_DIR'])}"
            ) from None
        if check and proc.returncode != 0:
            ranks = rank_tails(full_env["PET_LOG_DIR"])
            # the launcher's lines on how the run ended (torchrun's report is in its file)
            summary = "\n".join(re.findall(r"^titan: .*$", proc.stderr, re.M))
            raise RunFailed(
                f"{' '.join(cmd)} (NGPU={nproc}) exited {proc.returncode}; "
                + (
                    f"last lines of every rank:\n{ranks}\n--- the launcher's summary ---\n{summary}"
                    if ranks
                    else f"no rank started; stderr:\n{proc.stderr[-3000:]}"
                )
            )
    return proc


def train(run: Run, common: list[str], dump_folder: str | Path, timeout: float = 600) -> list[dict]:
    """The run's metrics records, with `val_loss` from validation.jsonl on the steps that
    validated."""
    launch(run.nproc, [*common, *run.overrides], dump_folder, timeout, run.env)
    records = read_metrics(dump_folder)
    if not records:
        raise RunFailed(f"{run.label()} wrote no metrics to {dump_folder}/metrics.jsonl")
    val = {r["step"]: r["val_loss"] for r in read_metrics(dump_folder, "validation.jsonl")}
    return [{**r, "val_loss": val[r["step"]]} if r["step"] in val else r for r in records]


def run_job(run: Run, common: list[str]):
    """The JobConfig `run` trains (run_train.sh's config file: the run's CONFIG_FILE)."""
    from titan.config import parse_args
    from titan.config.manager import DEFAULT_CONFIG_FILE

    config = {**os.environ, **(run.env or {})}.get("CONFIG_FILE", DEFAULT_CONFIG_FILE)
    return parse_args(["--job.config_file", config, *common, *run.overrides])


def check_keys(keys: list[str], runs: dict[str, Run], common: list[str]) -> None:
    """ValueError for a key no run can log: val_loss without validation."""
    if "val_loss" not in keys:
        return
    for name, run in runs.items():
        if not run_job(run, common).validation.enable:
            raise ValueError(
                f"--keys val_loss: the {name} run does not validate; add "
                "--validation.enable to --common"
            )


def global_batch(run: Run, common: list[str]) -> int:
    """The sequences per optimizer step of `run`, as the launcher will resolve them."""
    from titan.plan.run_plan import plan_run

    return plan_run(run_job(run, common), world_size=run.nproc).global_batch_size


def check_same_global_batch(runs: dict[str, Run], common: list[str]) -> None:
    """ValueError unless every run trains the same global batch: with the default
    global_batch_size (-1, local x dp) it grows with the ranks, and the losses with it."""
    sizes = {name: global_batch(run, common) for name, run in runs.items()}
    if len(set(sizes.values())) > 1:
        each = ", ".join(f"{name} ({runs[name].label().strip()}) {n}" for name, n in sizes.items())
        fix = math.lcm(*sizes.values())
        raise ValueError(
            f"the runs train different global batches ({each} sequences), so their "
            "losses differ by design; give every run the same one, e.g. --common "
            f'"... --training.global_batch_size {fix}"'
        )


def compare(base: list[dict], other: list[dict], key: str = "loss") -> list[tuple]:
    """Rows (step, base value, other value, relative difference) over the common steps."""
    other_by_step = {r["step"]: r for r in other}
    rows = []
    for r in base:
        o = other_by_step.get(r["step"])
        if o is None:
            raise ValueError(f"step {r['step']} is missing from the compared run")
        if key not in r or key not in o:
            known = sorted(k for k, v in r.items() if isinstance(v, (int, float)) and k != "step")
            raise ValueError(
                f"--keys {key}: step {r['step']} logged no {key!r}; the runs log {', '.join(known)}"
            )
        a, b = r[key], o[key]
        rows.append((r["step"], a, b, abs(a - b) / max(abs(a), 1e-12)))
    return rows


def compare_key(base: list[dict], other: list[dict], key: str) -> list[tuple]:
    """compare() over the steps of `base` that logged `key` (val_loss: those that validated)."""
    logged = [r for r in base if key in r] if key == "val_loss" else base
    if not logged:
        raise ValueError(f"--keys {key}: the baseline logged no {key}")
    return compare(logged, other, key)


def format_table(rows: list[tuple], key: str, base_label: str, other_label: str) -> str:
    lines = [
        f"{key} per step — A: {base_label}\n{'':>{len(key) + 12}}B: {other_label}",
        f"{'step':>6} {'A':>14} {'B':>14} {'rel diff':>10}",
    ]
    lines += [f"{s:>6} {a:>14.8f} {b:>14.8f} {d:>10.2e}" for s, a, b, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m titan.tools.loss_compare",
        description="Train two configurations (same seed and data) and compare losses per step. "
        "Exits 1 if any step differs by more than --rtol (relative), 2 if the runs "
        "cannot be compared (a config error, or different global batches: set "
        "--training.global_batch_size in --common).",
    )
    ap.add_argument("--baseline", required=True, help="'NPROC:overrides', e.g. '1:'")
    ap.add_argument(
        "--candidate",
        required=True,
        action="append",
        help="'NPROC:overrides', e.g. '4:--parallelism.data_parallel_shard_degree 4'",
    )
    ap.add_argument("--common", default="", help="overrides for every run")
    ap.add_argument("--keys", default="loss", help="comma-separated metrics to compare")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--out", default="./outputs/loss_compare", help="parent of the dump folders")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)

    common = shlex.split(args.common)
    base = Run.parse(args.baseline)
    runs = {
        "baseline": base,
        **{
            f"candidate {i}" if len(args.candidate) > 1 else "candidate": Run.parse(c)
            for i, c in enumerate(args.candidate)
        },
    }
    from titan.config import ConfigError

    keys = args.keys.split(",")
    try:  # before any training: a mistake costs a second, not two runs
        check_same_global_batch(runs, common)
        check_keys(keys, runs, common)
    except ConfigError as e:
        print(f"loss_compare: config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"loss_compare: {e}", file=sys.stderr)
        return 2
    base_records = train(base, common, Path(args.out) / "baseline", args.timeout)
    worst = 0.0
    for i, spec in enumerate(args.candidate):
        cand = Run.parse(spec)
        records = train(cand, common, Path(args.out) / f"candidate{i}", args.timeout)
        for key in keys:
            try:
                rows = compare_key(base_records, records, key)
            except ValueError as e:
                print(f"loss_compare: {e}", file=sys.stderr)
                return 2
            print(format_table(rows, key, base.label(), cand.label()))
            worst = max(worst, max(d for *_, d in rows))
    verdict = "PASS" if worst <= args.rtol else "FAIL"
    print(f"{verdict}: largest relative difference {worst:.2e} (tolerance {args.rtol:.0e})")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
