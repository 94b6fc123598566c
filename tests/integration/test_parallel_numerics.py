"""Every data/tensor-parallel layout trains to the 1-rank losses (CPU, gloo, fp32).

Each case is a real ./run_train.sh launch compared step by step with one 1-rank baseline run
on the same seed and data: the global batch (8 sequences) is the same set of sequences
in every layout, and every layout starts from the same weights.
"""

import pytest

from titan.tools.loss_compare import compare, format_table, launch, read_metrics

STEPS = 10
GLOBAL_BATCH = 8
COMMON = ["--training.steps", str(STEPS), "--training.seq_len", "64",
          "--training.mixed_precision_param", "float32", "--training.deterministic",
          "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "3",
          "--metrics.no_enable_tensorboard"]
RTOL = 1e-5


def _dp(n):
    return ["--training.local_batch_size", str(GLOBAL_BATCH // n)]


CASES = {
    "fsdp2": (2, _dp(2)),
    "fsdp4": (4, _dp(4)),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2", *_dp(4)]),
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1", *_dp(2)]),
    "tp2_sp_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2", *_dp(1)]),
    "tp2_no_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2",
                                 "--parallelism.disable_loss_parallel", *_dp(1)]),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", *_dp(2)]),
    "hsdp2x2_tp2": (8, ["--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.tensor_parallel_degree", "2", *_dp(4)]),
    "fsdp2_full_ac": (2, ["--activation_checkpoint.mode", "full", *_dp(2)]),
    "fsdp2_selective_op_ac": (2, ["--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "op", *_dp(2)]),
    "fsdp2_compile": (2, ["--compile.enable", *_dp(2)]),
    "fsdp2_cpu_offload": (2, ["--training.enable_cpu_offload", *_dp(2)]),
    "grad_accum_4x": (1, ["--training.local_batch_size", "2",
                          "--training.global_batch_size", str(GLOBAL_BATCH)]),
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    dump = tmp_path_factory.mktemp("baseline")
    launch(1, [*COMMON, *_dp(1)], dump, timeout=300)
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it learns, so the curve says something
    return records


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case, baseline, tmp_path):
    nproc, overrides = CASES[case]
    launch(nproc, [*COMMON, *overrides], tmp_path, timeout=600)
    records = read_metrics(tmp_path)
    rows = compare(baseline, records, "loss")
    print(format_table(rows, "loss", "1 rank", f"{case} on {nproc} ranks"))
    assert len(rows) == STEPS
    worst = max(d for *_, d in rows)
    assert worst <= RTOL, format_table(rows, "loss", "1 rank", case)
    # the global gradient norm (over every shard and mesh dim) matches too
    norms = compare(baseline, records, "grad_norm")
    assert max(d for *_, d in norms) <= 1e-4, format_table(norms, "grad_norm", "1 rank", case)


def test_layout_errors_are_reported_before_launch(tmp_path):
    proc = launch(4, [*COMMON, "--parallelism.tensor_parallel_degree", "3"], tmp_path / "x",
                  check=False, timeout=120)
    assert proc.returncode == 2
    assert "world size 4 is not divisible" in proc.stderr
    proc = launch(2, [*COMMON, "--parallelism.data_parallel_shard_degree", "2",
                      "--training.local_batch_size", "3", "--training.global_batch_size", "8"],
                  tmp_path / "y", check=False, timeout=120)
    assert proc.returncode == 2 and "global_batch_size 8 must be a multiple" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
