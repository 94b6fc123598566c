"""bf16 mixed precision, titan's default (the other tests force fp32): compute in bf16 with fp32
master weights, by autocast on one rank and by FSDP's mixed-precision policy on two.

bf16 matmuls have no fast kernel on CPUs without AVX512-BF16/AMX (about 100x slower than
fp32 on the CI machines), so the model sees 16-token sequences here.
"""

import sys

import pytest

from tests.forked import run_trainer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 4
COMMON = ["--training.steps", str(STEPS), "--training.seq_len", "16",
          "--training.global_batch_size", "4", "--optimizer.lr", "5e-3",
          "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
          "--metrics.no_enable_tensorboard", "--metrics.peak_flops", "1e12"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]


def test_bf16_trains_close_to_fp32(tmp_path):
    fp32 = run_trainer(tmp_path / "fp32", 1, [*COMMON, "--training.mixed_precision_param",
                                               "float32", "--training.local_batch_size", "4"])
    autocast = run_trainer(tmp_path / "autocast", 1, [*COMMON, *BF16,
                                                      "--training.local_batch_size", "4"])
    fsdp = run_trainer(tmp_path / "fsdp", 2, [*COMMON, *BF16, "--training.local_batch_size", "2"])
    worst = {}
    for name, run in (("autocast", autocast), ("fsdp", fsdp)):
        assert [r["step"] for r in run] == list(range(1, STEPS + 1))
        worst[name] = max(abs(r["loss"] - f["loss"]) / f["loss"] for r, f in zip(run, fp32))
        # within one bf16 rounding step (2^-8 relative): measured 7e-5 (autocast), 5e-4 (FSDP)
        assert 0 < worst[name] < 2**-8, worst
        assert run[-1]["loss"] < run[0]["loss"] - 0.2  # it learns
    # the two bf16 paths round in different places: they differ from each other too
    assert any(a["loss"] != b["loss"] for a, b in zip(autocast, fsdp))
    print(f"largest relative loss difference to fp32 over {STEPS} steps: {worst}")
