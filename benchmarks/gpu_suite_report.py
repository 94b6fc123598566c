"""The GPU suite's numbers: per-row figures from the runs' metrics, the titan/torchtitan
ratios, the target checks, and the markdown table."""

import math
import statistics

from gpu_suite_rows import TARGET_ASYNC_PCT, TARGET_MEM_RATIO, TARGET_MFU_PCT, TARGET_TPS_RATIO


def training_figures(
    records: list[dict], warmup: int, flops_per_token: float, peaks: dict, last: int | None = None
) -> dict:
    """tokens/s over the steps after `warmup` up to `last` (total tokens / total time: each
    record is one step), MFU against each peak, peak memory over the whole run, first and last
    loss (of step `last`)."""
    if last is not None:
        records = [r for r in records if r["step"] <= last]
    steady = [r["tps"] for r in records if r["step"] > warmup and r.get("tps", 0) > 0]
    if not steady:
        raise ValueError(f"no step after the {warmup} warm-up steps logged tokens/s")
    tps = len(steady) / sum(1 / t for t in steady)
    out = {
        "tps": tps,
        "steps_timed": len(steady),
        "peak_memory_gib": max(r.get("memory_gib", 0.0) for r in records),
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
        "flops_per_token": flops_per_token,
    }
    for name, peak in peaks.items():
        out[f"mfu_{name}_pct"] = 100 * tps * flops_per_token / peak if peak else None
    return out


def checkpoint_figures(times: list[dict]) -> dict:
    """Training blocked per save: save() plus, for an async save, the wait for its staging
    copy. The first async save (it allocates the staging buffers) and the final save (always
    blocking) are reported apart; the saves between are the steady state."""
    saves = [t for t in times if t["event"] == "save"]
    waits = {t["step"]: t["seconds"] for t in times if t["event"] == "staging_wait"}
    blocked = [(t["step"], t["seconds"] + waits.get(t["step"], 0.0), t["async"]) for t in saves]
    middle = blocked[:-1]  # the final save blocks in every mode
    async_saves = [b for b in middle if b[2]]
    steady = async_saves[1:] if async_saves else middle
    if not steady:
        raise ValueError(f"no save between the first and the last to time: {times}")
    return {
        "blocked_s": statistics.fmean(b for _, b, _ in steady),
        "first_async_blocked_s": async_saves[0][1] if async_saves else None,
        "final_save_s": blocked[-1][1],
        "saves": len(saves),
        "ran_async": bool(async_saves),
    }


def _check(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "fail")


def compare(results: list[dict]) -> None:
    """Add ratios and target checks to the results in place."""
    last_train = None
    for r in results:
        if r["kind"] == "train":
            last_train = r
            r["checks"], r["tps_ratio"], r["mem_ratio"] = {}, None, None
            if (
                r["status"] == "ok"
                and "8B" in r["shape"]
                and not r["float8"]
                and r["dtype"] == "bfloat16"
            ):
                mfu = r.get("mfu_datasheet_pct")
                r["checks"][f"mfu>={TARGET_MFU_PCT:g}%"] = _check(
                    None if mfu is None else mfu >= TARGET_MFU_PCT
                )
        elif r["kind"] == "peer" and last_train is not None:
            both = r["status"] == "ok" and last_train["status"] == "ok"
            tps_ratio = last_train["tps"] / r["tps"] if both else None
            mem_ratio = (
                last_train["peak_memory_gib"] / r["peak_memory_gib"]
                if both and r["peak_memory_gib"] > 0
                else None
            )
            last_train["tps_ratio"], last_train["mem_ratio"] = tps_ratio, mem_ratio
            last_train["checks"][f"tps>={TARGET_TPS_RATIO:g}x"] = _check(
                None if tps_ratio is None else tps_ratio >= TARGET_TPS_RATIO
            )
            last_train["checks"][f"mem<={TARGET_MEM_RATIO:g}x"] = _check(
                None if mem_ratio is None else mem_ratio <= TARGET_MEM_RATIO
            )
    ckpt = [r for r in results if r["kind"] == "checkpoint"]
    sync = next(
        (r for r in ckpt if r["checkpoint_mode"] == "disabled" and r["status"] == "ok"), None
    )
    for r in ckpt:
        if r["checkpoint_mode"] != "disabled":
            pct = (
                100 * r["blocked_s"] / sync["blocked_s"]
                if sync and r["status"].startswith("ok") and sync["blocked_s"] > 0
                else None
            )
            r["pct_of_sync"] = pct
            r["sync_blocked_s"] = sync["blocked_s"] if sync else None
            r["checks"] = {
                f"blocked<{TARGET_ASYNC_PCT:g}% of sync": _check(
                    None if pct is None else pct < TARGET_ASYNC_PCT
                )
            }


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec)


def table(results: list[dict]) -> str:
    head = (
        "| row | side | status | tok/s | MFU datasheet % | MFU matmul % | peak mem GiB | "
        "loss first→last | titan/torchtitan tok/s | mem | checks |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        side = {"train": "titan", "peer": "torchtitan", "checkpoint": "titan", "tests": "titan"}[
            r["kind"]
        ]
        status = r["status"] if len(r["status"]) < 60 else r["status"][:57] + "..."
        checks = ", ".join(f"{k} {v}" for k, v in r.get("checks", {}).items())
        if r["kind"] in ("train", "peer"):
            loss = f"{r['loss_first']:.3f}→{r['loss_last']:.3f}" if "loss_last" in r else "n/a"
            cells = [
                _fmt(r.get("tps"), ",.0f"),
                _fmt(r.get("mfu_datasheet_pct"), ".1f"),
                _fmt(r.get("mfu_matmul_pct"), ".1f"),
                _fmt(r.get("peak_memory_gib"), ".2f"),
                loss,
                _fmt(r.get("tps_ratio"), ".3f"),
                _fmt(r.get("mem_ratio"), ".3f"),
            ]
        elif r["kind"] == "checkpoint":
            what = f"blocked {_fmt(r.get('blocked_s'), '.3f')} s" + (
                f" = {_fmt(r.get('pct_of_sync'), '.1f')}% of sync"
                if r["checkpoint_mode"] != "disabled"
                else ""
            )
            cells = [what, "", "", "", "", "", ""]
        else:
            cells = [r.get("summary", ""), "", "", "", "", "", ""]
        lines.append("| " + " | ".join([r["name"], side, status, *cells, checks]) + " |")
    return "\n".join(lines)
