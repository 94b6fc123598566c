"""The chunked cross-entropy (training.loss_chunk_tokens): the same losses as the whole-logits
loss, on one rank and across layouts (pipelines included), with a family's extra head
(DeepSeek-V3's multi-token prediction), and less planned memory; refused where it does not
apply."""

import sys

import pytest

from tests.forked import run_trainer, tiny_run
from tests.unit.test_cp_documents import FAMILIES
from tests.unit.test_memory_plan import planned_bytes
from titan.components.training.chunked_loss import ChunkedLossOutput
from titan.config import ConfigError, parse_args

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 5
# a microbatch holds 4 x 32 = 128 tokens: chunks of 40, 40, 40 and 8
CHUNK = ["--training.loss_chunk_tokens", "40"]
DEEPSEEK_MTP = [*FAMILIES["deepseek_v3"], "--deepseek_v3.mtp_depth", "1"]


def losses(tmp_path, name, world, *extra):
    return run_trainer(tmp_path / name, world, [*tiny_run(STEPS), *extra], deadline_s=120)


def close(a, b, bound, keys=("loss",)):
    for x, y in zip(a, b, strict=True):
        for k in keys:
            assert abs(x[k] - y[k]) <= bound * abs(x[k]), (k, x, y)


@pytest.mark.parametrize("family", ["llama3", "deepseek_mtp"])
def test_chunked_equals_whole_logits_on_one_rank(family, tmp_path):
    extra = DEEPSEEK_MTP if family == "deepseek_mtp" else []
    whole = losses(tmp_path, "whole", 1, *extra)
    chunked = losses(tmp_path, "chunked", 1, *extra, *CHUNK)
    # the same sums of the same float32 terms, added chunk by chunk
    close(whole, chunked, 1e-6, ("loss", "mtp_loss") if extra else ("loss",))


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2"],
        ["--parallelism.context_parallel_degree", "2"],
        ["--parallelism.pipeline_parallel_degree", "2"],
        # V-shaped: rank 0 holds the first and the last stage
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
        ],
    ],
    ids=["fsdp2", "cp2", "pp2", "pp2_zbv"],
)
def test_chunked_under_a_layout_equals_one_rank(layout, tmp_path, monkeypatch):
    marker = tmp_path / "chunked_ran"
    forward = ChunkedLossOutput.forward

    def recorded(self, h, labels=None):  # the forked ranks inherit it: the chunks ran
        if labels is not None:
            marker.touch()
        return forward(self, h, labels)

    one = losses(tmp_path, "one", 1)
    monkeypatch.setattr(ChunkedLossOutput, "forward", recorded)
    close(one, losses(tmp_path, "two", 2, *layout, *CHUNK), 1e-5)
    assert marker.exists()


def test_the_plan_holds_one_chunk_of_logits(tmp_path):
    argv = [*tiny_run(1), "--training.seq_len", "256"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = planned_bytes(argv, 1, tmp_path / "a")[0]
    chunked = planned_bytes([*argv, "--training.loss_chunk_tokens", "64"], 1, tmp_path / "b")[0]
    assert chunked["params_bytes"] == whole["params_bytes"]
    # 4 x 256 tokens x 2048 vocabulary x 4 bytes of logits each, held and transient
    logits = 4 * 256 * 2048 * 4
    assert whole["transient_bytes"] - chunked["transient_bytes"] == logits - 64 * 2048 * 4
    assert whole["activations_bytes"] - chunked["activations_bytes"] >= logits


@pytest.mark.parametrize(
    "flags,why",
    [
        (["--parallelism.tensor_parallel_degree", "2"], "vocabulary-parallel"),
        (["--training.loss_chunk_tokens", "-1"], "must be >= 0"),
    ],
)
def test_refused_where_it_does_not_apply(flags, why):
    with pytest.raises(ConfigError, match="training.loss_chunk_tokens") as e:
        parse_args([*CHUNK, *flags])
    assert why in str(e.value)


@pytest.mark.needs("torchao")
@pytest.mark.parametrize(
    "fqns, refused", [("wq", True), ("wq,output", False)], ids=["output_converted", "left_out"]
)
def test_an_output_layer_an_earlier_converter_rewrote_is_refused_when_planned(fqns, refused):
    """What the converters before it made of the output layer, not their names, decides."""
    from titan.plan.run_plan import plan_run

    flags = ["--model.converters", "float8", "--float8.emulate", "--float8.filter_fqns", fqns]
    job = parse_args([*CHUNK, *flags])
    if not refused:
        plan_run(job, 1)
        return
    with pytest.raises(ConfigError, match="the float8 converter made a Float8Linear"):
        plan_run(job, 1)
