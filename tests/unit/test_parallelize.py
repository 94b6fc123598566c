"""Parallelization paths that the layout matrix does not cover, each trained on forked ranks
against one rank: TP without sequence parallelism, whole-model compile under TP (the CPU
path), and activation checkpointing of every N-th block."""

import sys

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy

from tests.forked import run_trainer
from titan.models.spec import get_train_spec
from titan.parallelisms.activation_checkpoint import apply_ac
from titan.parallelisms.sections import ActivationCheckpoint

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 5
COMMON = [
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.no_enable_tensorboard",
    "--metrics.peak_flops",
    "1e12",
]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_trainer(tmp_path_factory.mktemp("one"), 1, COMMON)


def assert_same_losses(a, b, rtol=1e-5):
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= rtol * x["loss"], (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 10 * rtol * x["grad_norm"], (x, y)


def test_tp_without_sequence_parallel(one_rank, tmp_path):
    records = run_trainer(tmp_path, 2, [*COMMON, *TP2, "--parallelism.no_enable_sequence_parallel"])
    assert_same_losses(one_rank, records)


def test_whole_model_compile_under_tp(one_rank, tmp_path):
    # per-block compile + TP fails in backward on CPU, so titan compiles the whole model there
    # aot_eager: dynamo + AOTAutograd over DTensors (where per-block compile breaks) without
    # inductor's C++ build, which the FSDP compile layouts cover
    records = run_trainer(
        tmp_path,
        2,
        [*COMMON, *TP2, "--compile.enable", "--compile.backend", "aot_eager"],
        deadline_s=300,
    )
    assert_same_losses(one_rank, records)


def test_checkpoint_every_nth_block(one_rank, tmp_path):
    cfg = ActivationCheckpoint(mode="selective", selective_ac_option="2")
    llama = get_train_spec("llama3")
    model = llama.build_meta(llama.flavors["debugmodel"])
    apply_ac(model.layers, cfg)
    wrapped = [isinstance(b, CheckpointWrapper) for b in model.layers.values()]
    assert wrapped == [True, False] * 3
    assert set(model.state_dict()) == set(
        llama.build_meta(llama.flavors["debugmodel"]).state_dict()
    )

    records = run_trainer(
        tmp_path,
        1,
        [
            *COMMON,
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
    )
    assert_same_losses(one_rank, records, rtol=1e-6)


def test_checkpointed_blocks_recompute_in_backward():
    llama = get_train_spec("llama3")
    args = llama.flavors["debugmodel"].with_updates(max_seq_len=8, vocab_size=64)
    model = llama.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    apply_ac(model.layers, ActivationCheckpoint(mode="selective", selective_ac_option="3"))
    calls = {name: 0 for name in model.layers}
    for name, block in model.layers.items():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        inner.register_forward_pre_hook(lambda m, a, n=name: calls.__setitem__(n, calls[n] + 1))
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    assert calls == {"0": 2, "1": 1, "2": 1, "3": 2, "4": 1, "5": 1}  # forward + recompute


def test_op_policy_counts_each_region_apart():
    """Blocks recompute in reverse order; torch <= 2.12 asks the policy again then, so each
    region's recompute must repeat its own forward's save/recompute choices (an odd matmul
    count in one block once shifted the next block's: a wrong saved output on torch 2.11)."""
    from types import SimpleNamespace

    from titan.parallelisms.activation_checkpoint import op_policy

    mm = torch.ops.aten.mm.default
    fwd, rec = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    regions = [op_policy() for _ in range(3)]
    counts = [7, 8, 3]  # a dense block (odd), an MoE block, another
    forward = [[p(fwd, mm) for _ in range(n)] for p, n in zip(regions, counts)]
    for i in reversed(range(3)):
        assert [regions[i](rec, mm) for _ in range(counts[i])] == forward[i]
    assert forward[0][:2] == [CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE]
