"""Does DeepSeek-V3's auxiliary-loss-free balancing balance? A debug MoE model (Qwen3-MoE's or
DeepSeek-V3's) trained twice through run_train.sh on the same data, once without any balancing
and once with the routing-bias update only, printing `expert_load_imbalance` (the largest over
MoE layers of max / mean tokens per expert in a step) and the loss, averaged over windows of
steps.

    python benchmarks/moe_balance.py [--family qwen3|deepseek_v3] [--steps 200] [--rate 0.001]
                                     [--window 20]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titan.tools.loss_compare import command, read_metrics  # noqa: E402

CONFIGS = {
    "qwen3": "train_configs/qwen3_moe_debug.toml",
    "deepseek_v3": "train_configs/deepseek_v3_debug.toml",
}


def train(family: str, name: str, rate: float, steps: int, scratch: Path) -> list[dict]:
    dump = scratch / name
    cmd, env = command(
        1,
        [
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--metrics.no_enable_tensorboard",
            f"--{family}.moe_aux_loss_coeff",
            "0",
            f"--{family}.moe_bias_update_rate",
            str(rate),
        ],
        dump,
        config_file=CONFIGS[family],
    )
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(dump)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=list(CONFIGS), default="qwen3")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rate", type=float, default=0.001, help="bias update rate (DeepSeek-V3's)")
    ap.add_argument("--window", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        off = train(a.family, "off", 0.0, a.steps, Path(scratch))
        on = train(a.family, "bias", a.rate, a.steps, Path(scratch))
    print(
        f"| steps | imbalance, balancing off | imbalance, bias update {a.rate} "
        "| loss off | loss bias |"
    )
    print("|---|---:|---:|---:|---:|")
    for start in range(0, a.steps, a.window):
        w_off, w_on = off[start : start + a.window], on[start : start + a.window]

        def mean(rows, key):
            return statistics.fmean(r[key] for r in rows)

        print(
            f"| {start + 1}-{start + len(w_off)} | {mean(w_off, 'expert_load_imbalance'):.3f} "
            f"| {mean(w_on, 'expert_load_imbalance'):.3f} | {mean(w_off, 'loss'):.3f} "
            f"| {mean(w_on, 'loss'):.3f} |"
        )


if __name__ == "__main__":
    main()
