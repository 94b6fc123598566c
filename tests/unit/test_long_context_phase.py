"""The long-context phase of a run: a checkpoint trained at a short seq_len resumes at a longer
one with RoPE stretched (YaRN), which the identity check allows only when asked
(--checkpoint.allow_rope_change), and trains the same on context parallelism as on 1 rank."""

import shutil
import sys

import pytest

from tests.forked import run_trainer, tiny_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
# YaRN stretches the 64 positions phase 1 trained at to 256 (factor 4)
ORIGINAL = ["--qwen3.rope_original_max_len", "64"]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "4"]


def phase_two(tmp_path, name, first, world, *extra):
    """Resume phase 1's checkpoint at seq 256 for steps 5-8 in a dump folder of its own."""
    dump = tmp_path / name / "dump"
    shutil.copytree(first / "dump" / "checkpoint", dump / "checkpoint")
    argv = [*QWEN3, *tiny_run(8), "--training.seq_len", "256", *ORIGINAL, *CHECKPOINT, *extra]
    return run_trainer(tmp_path / name, world, argv, deadline_s=200)


@pytest.mark.slow("two phases on 1 rank and on CP 2")
def test_resume_at_a_longer_context_with_yarn_on_cp2_equals_one_rank(tmp_path):
    first = tmp_path / "phase1"
    short = run_trainer(
        first, 1, [*QWEN3, *tiny_run(4), "--training.seq_len", "64", *ORIGINAL, *CHECKPOINT]
    )
    assert [r["step"] for r in short] == [1, 2, 3, 4]
    yarn = ["--qwen3.rope_scaling_factor", "4", "--checkpoint.allow_rope_change"]
    one = phase_two(tmp_path, "one", first, 1, *yarn)
    cp2 = phase_two(tmp_path, "cp2", first, 2, *yarn, "--parallelism.context_parallel_degree", "2")
    assert [r["step"] for r in one] == [r["step"] for r in cp2] == [5, 6, 7, 8]
    for a, b in zip(one, cp2, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
    # the stretch took effect: the same resume with plain RoPE starts elsewhere
    plain = phase_two(tmp_path, "plain", first, 1)
    assert abs(plain[0]["loss"] - one[0]["loss"]) > 1e-3, (plain[0], one[0])
