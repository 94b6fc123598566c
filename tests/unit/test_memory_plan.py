"""The memory planner's parameter, gradient and optimizer bytes equal what the trainer holds
at its first step, rank by rank, in every layout, and its activations are within 10% of the
trainer's measured ones (forked ranks, 1 step each); --suggest's layouts pass the launcher
and its first runs."""

import json
import sys

import pytest

from tests.forked import run_trainer, run_workers, tiny_run
from tests.layouts import degrees
from titan.config import parse_args
from titan.plan.run_plan import plan_run
from titan.planner.memory import rank_bytes

ONE_STEP = tiny_run(1)
LAYOUTS = {
    "1rank_bf16_states": (1, ["--optimizer.state_dtype", "bfloat16"]),
    "fsdp2_full_ac": (2, ["--activation_checkpoint.mode", "full"]),
    "fsdp2_tp2_selective_ac": (
        4,
        [*degrees(tensor_parallel=2), "--activation_checkpoint.mode", "selective"],
    ),
    # TP without FSDP: each gradient in its weight's sharding (the embedding's came whole)
    "tp2": (2, degrees(tensor_parallel=2)),
    "hsdp2x2": (4, [*degrees(data_parallel_replicate=2), "--training.local_batch_size", "2"]),
    "cp2": (2, degrees(context_parallel=2, data_parallel_shard=1)),
    "pp2_1f1b_tied": (2, [*degrees(pipeline_parallel=2), "--model.flavor", "debugmodel_tied"]),
    "pp2_interleaved": (
        2,
        [
            *degrees(pipeline_parallel=2),
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_layers_per_stage",
            "1",
        ],
    ),
}
AC = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective": ["--activation_checkpoint.mode", "selective"],
}
# every layout has one AC mode above; these add the others where they act differently
LAYOUTS.update(
    {
        "1rank_full_ac": (1, AC["full"]),
        "1rank_selective_ac": (1, AC["selective"]),
        "fsdp2_tp2_full_ac": (4, ["--parallelism.tensor_parallel_degree", "2", *AC["full"]]),
        "cp2_selective_ac": (2, [*LAYOUTS["cp2"][1], *AC["selective"]]),
        "hsdp2x2_full_ac": (4, [*LAYOUTS["hsdp2x2"][1], *AC["full"]]),
        "pp2_1f1b_full_ac": (2, [*LAYOUTS["pp2_1f1b_tied"][1], *AC["full"]]),
        "pp2_interleaved_selective_ac": (2, [*LAYOUTS["pp2_interleaved"][1], *AC["selective"]]),
    }
)
# LoRA: the frozen base's weights held, only the adapters' gradients and moments; per-op AC
# recomputes the low-rank products
LORA = ["--lora.rank", "8", "--lora.target_modules", r"attention\.w\w*$,feed_forward\.w[123]$"]
LAYOUTS.update(
    {
        "1rank_lora": (1, LORA),
        "fsdp2_tp2_lora_selective_ac": (
            4,
            [*LORA, "--parallelism.tensor_parallel_degree", "2", *AC["selective"]],
        ),
    }
)
# bf16 compute: autocast on one rank, FSDP's param dtype, bf16 pipeline stage tensors;
# float8 (emulated) under FSDP with bf16
BF16 = ["--training.mixed_precision_param", "bfloat16"]
F8 = ["--model.converters", "float8", "--float8.emulate"]
LAYOUTS.update(
    {
        "1rank_bf16_autocast": (1, BF16),
        "fsdp2_bf16_selective_ac": (2, [*BF16, *AC["selective"]]),
        # FSDP gives the stages bf16 (without it, pipelines compute in float32)
        "pp2_fsdp2_bf16": (4, [*BF16, "--parallelism.pipeline_parallel_degree", "2"]),
        "fsdp2_float8_bf16_full_ac": (2, [*F8, *BF16, *AC["full"]]),
    }
)
# Muon: a momentum buffer per matrix, AdamW's states for the rest (titan.components.optim)
MUON = ["--optimizer.name", "Muon"]
LAYOUTS.update(
    {
        "muon_fsdp2_tp2": (4, [*MUON, "--parallelism.tensor_parallel_degree", "2"]),
        "muon_pp2_tied": (2, [*MUON, *LAYOUTS["pp2_1f1b_tied"][1]]),
    }
)
# Qwen3-MoE: experts sharded by FSDP, router and experts whole on each TP rank; the routing
# bias (a buffer) is no parameter; bf16 takes the per-expert loop, float32 the grouped GEMM
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
MTP = ["--deepseek_v3.mtp_depth", "2"]
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
LAYOUTS.update(
    {
        "moe_fsdp2_tp2_selective_ac": (
            4,
            [*MOE, "--parallelism.tensor_parallel_degree", "2", *AC["selective"]],
        ),
        "moe_pp2_bias_full_ac": (
            2,
            [
                *MOE,
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--qwen3.moe_bias_update_rate",
                "0.001",
                *AC["full"],
            ],
        ),
        "moe_fsdp2_bf16": (2, [*MOE, *BF16]),
        # DeepSeek-V3: MLA's latents whole on each TP rank, heads split; shared experts split
        "deepseek_fsdp2_tp2_selective_ac": (
            4,
            [
                "--model.name",
                "deepseek_v3",
                "--model.flavor",
                "debugmodel",
                "--parallelism.tensor_parallel_degree",
                "2",
                *AC["selective"],
            ],
        ),
        # GPT-OSS: sinks split with the heads, biased experts, windowed layers (the mask one
        # bool tensor for all), softmax over every row and its sink
        "gpt_oss_fsdp2_tp2_selective_ac": (
            4,
            [*GPT_OSS, "--parallelism.tensor_parallel_degree", "2", *AC["selective"]],
        ),
        "gpt_oss_pp2": (2, [*GPT_OSS, "--parallelism.pipeline_parallel_degree", "2"]),
        # every rank's keys and values gathered in each layer, masked by position
        "gpt_oss_cp2": (2, [*GPT_OSS, "--parallelism.context_parallel_degree", "2"]),
        # documents under CP: every rank's keys gathered, the mask by document and position
        "cp2_block_causal": (
            2,
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--model.attn_mask_type",
                "block_causal",
                "--model.document_positions",
            ],
        ),
        # all-to-all CP: a head group's whole-sequence q, k, v inside attention
        "cp2_alltoall_gpt_oss": (
            2,
            [
                *GPT_OSS,
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.context_parallel_type",
                "alltoall",
            ],
        ),
        # the hybrid: all-to-all in pairs, a ring of the pairs' keys and values across them
        "cp4_hybrid": (
            4,
            [
                "--parallelism.context_parallel_degree",
                "4",
                "--parallelism.context_parallel_type",
                "hybrid",
            ],
        ),
        # a chunked loss: one chunk's logits at a time, none kept for backward
        "chunked_loss": (1, ["--training.loss_chunk_tokens", "40"]),
        "fsdp2_chunked_loss_mtp": (
            2,
            [
                *DEEPSEEK,
                "--deepseek_v3.mtp_depth",
                "1",
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--training.loss_chunk_tokens",
                "40",
            ],
        ),
        # a chunked loss on the last stage of a pipeline
        "pp2_chunked_loss": (
            2,
            ["--parallelism.pipeline_parallel_degree", "2", "--training.loss_chunk_tokens", "40"],
        ),
        # DeepSeek-V3 with two multi-token-prediction depths on the last stage
        "deepseek_mtp_pp2": (
            2,
            [
                "--model.name",
                "deepseek_v3",
                "--model.flavor",
                "debugmodel",
                "--deepseek_v3.mtp_depth",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
        ),
        "deepseek_mtp_fsdp2": (
            2,
            ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *MTP],
        ),
        # expert parallelism: each rank holds half the experts (whole, on both tp ranks), the
        # dense weights sharded (the imbalanced-routing bound: tests/unit/test_deepseek_v3.py)
        "deepseek_ep2_tp2": (
            4,
            [
                "--model.name",
                "deepseek_v3",
                "--model.flavor",
                "debugmodel",
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
        ),
    }
)


# zero-bubble schedules: a backward split into input (I) and weight (W) parts; 4 microbatches
# of 1 fill ZBV's and DualPipeV's 4 stages
# Qwen3-Next: Gated DeltaNet's chunked recurrence and convolution, gated attention, the
# gated shared expert (titan.models.qwen3_next)
NEXT = ["--model.name", "qwen3_next", "--model.flavor", "debugmodel"]
LAYOUTS.update(
    {
        "next_fsdp2_tp2": (4, [*NEXT, "--parallelism.tensor_parallel_degree", "2"]),
        "next_pp2_selective_ac": (
            2,
            [*NEXT, "--parallelism.pipeline_parallel_degree", "2", *AC["selective"]],
        ),
    }
)
ZERO_BUBBLE = ["--parallelism.pipeline_parallel_degree", "2"]
for name, schedule in (
    ("pp2_zbv", "ZBVZeroBubble"),
    ("pp2_dualpipev", "DualPipeV"),
    ("pp2_interleaved_zb", "InterleavedZeroBubble"),
):
    LAYOUTS[name] = (2, [*ZERO_BUBBLE, "--parallelism.pipeline_parallel_schedule", schedule])


def _plan_in_child(rank, world_size, argv, nproc):
    job = parse_args(argv)
    plan = plan_run(job, nproc)
    return [rank_bytes(job, plan, r, worst_routing=True) for r in range(nproc)]


def planned_bytes(argv, nproc, tmp_path) -> list[dict]:
    """The plan, made in a forked child: its fake process group and the meshes torch caches
    for it must not reach the ranks later tests fork from this process."""
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    return run_workers(_plan_in_child, 1, plan_dir, argv, nproc, init_pg=False, barrier=False)[0]


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=pytest.mark.needs("torchao") if "float8" in args else ())
        for case, (_, args) in LAYOUTS.items()
    ],
)
def test_planned_state_bytes_equal_measured(case, tmp_path):
    nproc, overrides = LAYOUTS[case]
    argv = [*ONE_STEP, *overrides]
    planned = planned_bytes(argv, nproc, tmp_path)

    def measured_problems(run_dir):
        run_trainer(run_dir, nproc, argv)
        measured = json.loads((run_dir / "dump" / "memory_measured.json").read_text())["ranks"]
        assert len(measured) == nproc
        problems = []
        for rank, (m, p) in enumerate(zip(measured, planned, strict=True)):
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert m[key] == p[key] > 0, (case, rank, key, m, p)
            ratio = p["activations_bytes"] / m["activations_bytes"]
            # the bar is 10%; every case is within 0.5% (RESULTS.md), so 2% catches a
            # regression of the walk (1F1B's kept output was one hidden state, 8% with full AC)
            if not 0.98 <= ratio <= 1.02:
                problems.append((case, rank, ratio, m, p))
        return problems

    problems = measured_problems(tmp_path)
    if problems:
        # selective-AC cases measured 1.16x-1.40x now and then in the full suite: garbage in
        # reference cycles counted as held (ActivationTracker now collects it first). A second
        # run guards against what else may vary between runs; a wrong plan fails both.
        (tmp_path / "again").mkdir()
        problems = measured_problems(tmp_path / "again")
    assert not problems, problems


def test_plan_cli_json_and_errors(tmp_path):
    import subprocess

    from titan.runtime.paths import REPO_ROOT

    def plan(*args):
        return subprocess.run(
            [sys.executable, "-m", "titan.planner", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    overrides = ["--parallelism.pipeline_parallel_degree", "2"]
    proc = plan("--ngpu", "4", "--device-memory", "1GiB", "--json", *overrides)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["layout"] == {
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 1,
        "tp": 1,
        "pp": 2,
        "ep": 1,
    }
    assert [r["rank"] for r in report["ranks"]] == [0, 2]  # one row per pipeline rank
    expected = planned_bytes(
        ["--job.config_file", "train_configs/debug_model.toml", *overrides], 4, tmp_path
    )
    for row in report["ranks"]:
        want = expected[row["rank"]]
        assert {k: row[k] for k in want} == want
        assert row["states_bytes"] == sum(
            want[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")
        )
    assert report["headroom_bytes"] == 2**30 - report["max_total_bytes"]
    for row in report["ranks"]:
        assert row["total_bytes"] == (
            row["states_bytes"] + row["activations_bytes"] + row["transient_bytes"]
        )
    table = plan("--ngpu", "4", *overrides).stdout
    assert "optimizer" in table and "activations" in table and "transient" in table
    bad = plan("--ngpu", "3", "--parallelism.tensor_parallel_degree", "2")
    assert bad.returncode == 2 and "world size 3 is not divisible" in bad.stderr


def test_launcher_refuses_states_that_cannot_fit():
    import os
    import subprocess

    from titan.runtime.paths import REPO_ROOT

    def dry_run(*overrides):
        return subprocess.run(
            ["bash", "run_train.sh", *overrides],
            cwd=REPO_ROOT,
            env={**os.environ, "DRY_RUN": "1", "NGPU": "2"},
            capture_output=True,
            text=True,
            timeout=120,
        )

    small = ["--memory.device_memory_gib", "0.2"]  # FSDP 2, no AC: 348 MiB per rank
    proc = dry_run(*small)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "rank 0 would need 347.9 MiB" in proc.stderr and "device's 204.8 MiB" in proc.stderr
    assert "biggest item: activations 274.9 MiB" in proc.stderr
    assert 'activation_checkpoint.mode = "selective" or "full"' in proc.stderr
    warned = dry_run(*small, "--memory.check", "warn")
    assert warned.returncode == 0 and "titan: warning: rank 0 would need" in warned.stderr
    full_ac = ["--activation_checkpoint.mode", "full"]  # 107 MiB: the same check passes
    proc = dry_run(*small, *full_ac, "--optimizer.state_dtype", "bfloat16")
    assert proc.returncode == 0 and "would need" not in proc.stderr, proc.stderr


def _suggest_in_child(rank, world_size, argv):
    """The suggestions, each put through the launcher's own checks (parse, every world
    size's plan with its plan checks, the memory check against 0.25 GiB among them)."""
    from titan.launcher.launch import validate_world_sizes
    from titan.planner.layout_search import Hardware, suggest

    job = parse_args(argv)
    found = suggest(job, plan_run(job, 4), 256 * 2**20, Hardware(gpus_per_node=4), top=3)
    for c in found:
        job = parse_args([*argv, *c.overrides(), "--memory.device_memory_gib", "0.25"])
        validate_world_sizes(job, 1, 1, 4)  # raises ConfigError if the launcher would refuse it
    return found


@pytest.mark.slow("the suggestion times its first candidates' real steps")
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_suggest_lists_launchable_layouts_and_the_first_runs(tmp_path):
    base = ["--job.config_file", "train_configs/debug_model.toml"]
    child = tmp_path / "suggest"
    child.mkdir()
    found = run_workers(
        _suggest_in_child, 1, child, base, init_pg=False, barrier=False, deadline_s=180
    )[0]
    assert len(found) == 3
    assert [c.step_s for c in found] == sorted(c.step_s for c in found)
    assert all(c.peak_bytes <= 0.9 * 256 * 2**20 for c in found)  # the 10% margin
    # the debug model's 348 MiB without AC on FSDP 2 do not fit: whatever wins, it was planned
    # under 230 MiB, and it trains
    first = found[0]
    run = tmp_path / "run"
    run.mkdir()
    records = run_trainer(
        run,
        4,
        [
            *base,
            *first.overrides(),
            "--training.steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--metrics.no_enable_tensorboard",
        ],
        deadline_s=180,
    )
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    measured = json.loads((run / "dump" / "memory_measured.json").read_text())["ranks"]
    assert all(m["activations_bytes"] > 0 for m in measured)
