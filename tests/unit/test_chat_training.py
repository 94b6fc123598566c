"""Training on chat data: the loss is the mean over the counted (assistant) tokens of the whole
global batch, so every layout and every gradient-accumulation setting trains the same."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.forked import run_trainer, tiny_run
from titan.components.data.dataloader import DataShard, build_dataloader
from titan.components.training.loss import IGNORE_INDEX
from titan.config import ConfigError, parse_args
from titan.plan.run_plan import plan_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 4
CHAT = [
    "--model.tokenizer_path",
    "assets/tokenizer_chat",
    "--model.attn_mask_type",
    "block_causal",
    "--training.dataset",
    "chat",
    "--training.dataset_format",
    "chat",
    "--training.seq_len",
    "64",
]


def losses(tmp_path, name, world, *extra):
    return run_trainer(tmp_path / name, world, [*tiny_run(STEPS), *CHAT, *extra], deadline_s=120)


def close(a, b, bound):
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= bound * abs(x["loss"]), (x["loss"], y["loss"])


VALIDATE = [
    "--validation.enable",
    "--validation.dataset",
    "chat_valid",
    "--validation.freq",
    str(STEPS),
    "--validation.steps",
    "1",
    "--validation.global_batch_size",
    "8",
]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """1 rank, the global batch of 8 in two microbatches of 4; validation on chat data."""
    path = tmp_path_factory.mktemp("chat_one")
    records = losses(path, "one", 1, *VALIDATE)
    validated = (path / "one" / "dump" / "validation.jsonl").read_text().splitlines()
    return records, [json.loads(line) for line in validated]


def test_validation_reads_chat_data(one_rank):
    (val,) = one_rank[1]
    assert val["step"] == STEPS and 0 < val["val_loss"] < 10


def test_first_loss_is_the_mean_over_counted_tokens(one_rank):
    """The step-1 loss against the same model and batch computed here: the counted tokens'
    mean over the whole global batch (not a mean of the microbatches' means)."""
    job = parse_args([*tiny_run(STEPS), *CHAT])
    plan = plan_run(job, world_size=1)
    loader = build_dataloader(
        job.training,
        tokenizer=plan.tokenizer,
        shard=DataShard(),
        global_batch_size=8,
        sections=job.extensions,
    )
    batches = iter(loader)
    model = plan.spec.build_meta(plan.model_args)
    model.to_empty(device="cpu")
    model.init_weights(job.training.seed, buffer_device=torch.device("cpu"))
    total, counted, means = 0.0, 0, []
    with torch.no_grad():
        for _ in range(2):
            batch = next(batches)
            inputs, labels, doc_ids = batch["input_ids"], batch["labels"], batch["doc_ids"]
            logits = model(inputs, doc_ids=doc_ids)
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            n = int((labels != IGNORE_INDEX).sum())
            total, counted = total + ce.item(), counted + n
            means.append(ce.item() / n)
    expected = total / counted
    assert abs(one_rank[0][0]["loss"] - expected) <= 1e-6 * expected
    # the microbatches count different numbers of tokens: the mean of means would differ
    assert abs(sum(means) / 2 - expected) > 1e-4 * expected


@pytest.mark.parametrize(
    "layout",
    [
        ["--training.local_batch_size", "8"],  # no accumulation
        ["--parallelism.data_parallel_shard_degree", "2"],
        ["--parallelism.tensor_parallel_degree", "2"],
        ["--parallelism.pipeline_parallel_degree", "2"],
        ["--parallelism.context_parallel_degree", "2"],
    ],
    ids=["1rank_no_accum", "fsdp2", "tp2", "pp2", "cp2"],
)
def test_layouts_train_the_same(layout, one_rank, tmp_path):
    world = 1 if layout[0] == "--training.local_batch_size" else 2
    close(one_rank[0], losses(tmp_path, "other", world, *layout), 1e-5)


def test_padded_conversations_train_without_document_masks(one_rank, tmp_path):
    """One conversation a window, causal attention: padding sits after each conversation, so
    nothing it attends to changes; only the windows (and so the batches) differ."""
    padded = losses(
        tmp_path,
        "pad",
        2,
        "--chat.packing",
        "pad",
        "--model.attn_mask_type",
        "causal",
        "--parallelism.data_parallel_shard_degree",
        "2",
    )
    assert all(r["loss"] > 0 for r in padded) and padded[-1]["loss"] < padded[0]["loss"]


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--model.attn_mask_type", "causal"], "packed conversations would attend to each other"),
        (["--training.dataset_streaming"], "chat data is read whole"),
        (["--model.tokenizer_path", "assets/tokenizer"], "has no chat template"),
    ],
)
def test_refused_before_training(flags, why):
    with pytest.raises(ConfigError, match=why):
        plan_run(parse_args([*tiny_run(1), *CHAT, *flags]), world_size=1)
