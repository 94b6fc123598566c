"""Rerun attribution of a flagged step (stability.rerun_on_spike): a corrupted document is
blamed on the data and named exactly (its dataset, index and place in the batch, checked
against a count of the whole stream), on 1 rank, FSDP 2, TP 2 and PP 2; a rank whose gradients are
perturbed once is blamed on the devices and named, on FSDP 2 and TP 2, and on_spike = stop then
ends the run naming it; replays leave a logged run's training bitwise as it was without them;
training.skip_documents masks that document's labels and moves nothing else."""

import json
import sys

import numpy as np
import pytest
import torch

from tests.forked import run_trainer, tiny_run
from titan.assembly.replay import Replay
from titan.components.data.dataloader import DataShard, build_text_dataloader
from titan.components.data.dataset import DataError
from titan.components.data.document_index import (
    DocSpan,
    document_range,
    label_documents,
    read_skip_file,
)
from titan.components.data.packed import PackedWindows
from titan.components.data.tokenizer import Tokenizer
from titan.components.training.blame import bisect, keep_labels
from titan.components.training.loss import IGNORE_INDEX
from titan.runtime.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEP, SAMPLE, SEQ = 8, 5, 32
SPIKES = ["--stability.spike_window", "4", "--stability.rerun_on_spike"]
BAD_DOC = ["--debug.bad_document_at_step", str(STEP), "--debug.bad_document_sample", str(SAMPLE)]
PERTURB = ["--debug.perturb_grads_at_step", str(STEP), "--debug.perturb_rank", "1"]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
}


def argv(on_spike: str, *extra: str, rerun: bool = True) -> list[str]:
    spikes = SPIKES if rerun else SPIKES[:-1]
    return [*tiny_run(10), *spikes, "--stability.on_spike", on_spike, *extra]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(str(REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"))


def loader(tokenizer, skip: str = ""):
    """The debug config's training data as the trainer reads it on 1 rank."""
    return build_text_dataloader(
        dataset="kjv",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=SEQ,
        local_batch_size=4,
        global_batch_size=8,
        shard=DataShard(0, 1),
        seed=0,  # the default training.seed, as the trainings below use
        skip_documents=skip,
    )


def document_of(tokenizer, global_batch: int, sample: int) -> tuple[int, list[int]]:
    """The document a sample's first label predicts, and its labels in the sample, from a
    count of BOS over the whole stream."""
    dl = loader(tokenizer)
    source, window = dl.order.batch_windows(global_batch)[sample]
    stream = dl.windows.sources[source].tokens
    tokens = stream.read(0, len(stream))
    doc_of = np.cumsum(tokens == tokenizer.bos_id) - 1
    labels = doc_of[window * (SEQ + 1) + 1 : (window + 1) * (SEQ + 1)]
    return int(labels[0]), [int(j) for j in np.flatnonzero(labels == labels[0])]


# ------------------------------------------------------------------ the index and the data


@pytest.mark.parametrize("in_memory", [False, True])
def test_each_labels_document_and_each_documents_range(tokenizer, in_memory):
    dl = loader(tokenizer)
    shards = dl.windows.sources[0].tokens
    tokens = shards.read(0, len(shards))
    stream = PackedWindows(tokens, SEQ, bos=tokenizer.bos_id).tokens if in_memory else shards
    doc_of = np.cumsum(tokens == tokenizer.bos_id) - 1
    for w in (0, 1, 500, len(tokens) // (SEQ + 1) - 1):
        start = w * (SEQ + 1)
        got = label_documents(stream, start, SEQ, tokenizer.bos_id)
        assert np.array_equal(got, doc_of[start + 1 : start + SEQ + 1])
    for d in (0, 7, int(doc_of[-1])):
        first, end = document_range(stream, d, tokenizer.bos_id)
        assert tokens[first] == tokenizer.bos_id and (doc_of[first:end] == d).all()
        assert end == len(tokens) or tokens[end] == tokenizer.bos_id


def test_a_step_names_every_document_of_its_global_batch(tokenizer):
    dl = loader(tokenizer)
    it = iter(dl)
    for _ in range(2 * STEP):  # 2 microbatches a step
        next(it)
    spans = dl.step_documents()
    assert sorted({s.sample for s in spans}) == list(range(8))
    doc, labels = document_of(tokenizer, STEP - 1, SAMPLE)
    mine = [s for s in spans if s.sample == SAMPLE and s.document == doc]
    assert [(s.first, s.end) for s in mine] == [(labels[0], labels[-1] + 1)]


def test_skipped_documents_lose_their_labels_and_nothing_else(tokenizer, tmp_path):
    doc, labels = document_of(tokenizer, STEP - 1, SAMPLE)
    skip = tmp_path / "skip.jsonl"
    skip.write_text(json.dumps({"dataset": "kjv", "document": doc}) + "\n")
    plain, skipping = iter(loader(tokenizer)), iter(loader(tokenizer, str(skip)))
    masked = 0
    for _ in range(2 * STEP):
        a, b = next(plain), next(skipping)
        assert torch.equal(a["input_ids"], b["input_ids"])
        differ = a["labels"] != b["labels"]
        assert (b["labels"][differ] == IGNORE_INDEX).all()
        masked += int(differ.sum())
    assert masked >= len(labels)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"dataset": "other", "document": 1}', "names dataset 'other'"),
        ('{"dataset": "kjv", "document": 99999}', "holds documents 0 to"),
        ('{"document": 1}', "is not"),
    ],
)
def test_a_bad_skip_file_is_one_data_error(tokenizer, tmp_path, line, message):
    skip = tmp_path / "skip.jsonl"
    skip.write_text(line + "\n")
    with pytest.raises(DataError, match=message):
        loader(tokenizer, str(skip))
    with pytest.raises(DataError, match="no such file"):
        read_skip_file(str(tmp_path / "absent.jsonl"), {})


# ------------------------------------------------------------------ the pieces


def test_the_kept_labels_are_the_spans_on_the_rank_that_holds_them():
    spans = [DocSpan(5, "d", 1, 2, 6), DocSpan(1, "d", 2, 0, 3)]
    labels = torch.arange(4 * 8).view(4, 8)
    # this rank holds samples 4-7 of the global batch, 2 a microbatch
    edited = keep_labels(spans, 4, 2)([{"labels": labels[:2]}, {"labels": labels[2:]}])
    want = torch.full((4, 8), IGNORE_INDEX)
    want[1, 2:6] = labels[1, 2:6]
    assert torch.equal(torch.cat([b["labels"] for b in edited]), want)


def test_bisection_finds_the_document_that_makes_the_spike():
    spans = [DocSpan(i, "d", 10 + i, 0, 8) for i in range(8)]
    spans.append(DocSpan(3, "d", 99, 8, 16))  # a sample of two documents

    def replay(kept):  # each document's share of the gradient; document 99's is huge
        norm = sum((20.0 if s.document == 99 else 0.3) ** 2 for s in kept) ** 0.5
        return 7.5 * sum(s.end - s.first for s in kept) / 72, norm

    found = bisect(spans, replay, score=lambda loss, norm: (norm - 1.2) / 0.1, sigma=6)
    assert [s.document for s in found.documents] == [99] and found.alone
    assert found.replays == 2 * 4  # 9 documents: 4 halvings of two replays


def test_ranks_whose_local_norms_changed_are_named():
    replay = Replay(7.0, 1.2, [(1.08, 1.08 * (1 + 1e-7)), (57.9, 0.58), (0.5, 0.5)])
    assert replay.differing_ranks() == [1]


# ------------------------------------------------------------------ trained


def spikes_of(dump) -> list[dict]:
    return [json.loads(x) for x in (dump / "spikes.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def blamed_document(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("doc")
    records = run_trainer(tmp, 1, argv("skip", *BAD_DOC), deadline_s=120)
    return records, spikes_of(tmp / "dump"), document_of(tokenizer, STEP - 1, SAMPLE)


def assert_names_the_document(spikes, want):
    doc, labels = want
    (spike,) = spikes
    assert spike["step"] == STEP and spike["verdict"] == "data" and spike["alone"]
    assert spike["rerun_grad_norm"] == spike["grad_norm"] and spike["rerun_loss"] == spike["loss"]
    assert spike["documents"] == [
        {"dataset": "kjv", "document": doc, "sample": SAMPLE, "labels": [0, labels[-1] + 1]}
    ]


def test_a_corrupted_document_is_blamed_on_the_data_and_named(blamed_document):
    records, spikes, want = blamed_document
    assert_names_the_document(spikes, want)
    assert records[STEP - 1]["skipped_steps"] == 1


@pytest.mark.slow("three 2-rank trainings with 7 replays of the flagged step")
def test_every_layout_names_the_same_document(blamed_document, tmp_path):
    pp2 = ["--parallelism.pipeline_parallel_degree", "2"]
    for name, flags in {**LAYOUTS, "pp2": pp2}.items():
        run_trainer(tmp_path / name, 2, argv("skip", *BAD_DOC, *flags), deadline_s=180)
        assert_names_the_document(spikes_of(tmp_path / name / "dump"), blamed_document[2])
        # the document blamed alone, in the form training.skip_documents reads
        suggested = (tmp_path / name / "dump" / "suggested_skip_documents.jsonl").read_text()
        assert suggested == json.dumps({"dataset": "kjv", "document": blamed_document[2][0]}) + "\n"


@pytest.mark.slow("two 2-rank trainings")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_perturbed_rank_is_blamed_on_the_devices_and_named(layout, tmp_path):
    records = run_trainer(tmp_path, 2, argv("skip", *PERTURB, *LAYOUTS[layout]), deadline_s=180)
    (spike,) = spikes_of(tmp_path / "dump")
    assert spike["step"] == STEP and spike["verdict"] == "compute" and spike["ranks"] == [1]
    norms = spike["rank_grad_norms"]
    assert norms[1][0] == pytest.approx(100 * norms[1][1], rel=1e-4)
    assert norms[0][0] == pytest.approx(norms[0][1], rel=1e-6)
    # the replay's figures are those of the step without the fault
    assert spike["rerun_grad_norm"] < spike["grad_norm"] / 10
    assert records[STEP - 1]["skipped_steps"] == 1


def test_a_device_fault_stops_the_run_naming_the_rank(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failed:
        run_trainer(tmp_path, 2, argv("stop", *PERTURB, *LAYOUTS["fsdp2"]), deadline_s=180)
    assert "StopTraining" in str(failed.value)
    assert "without the node(s) of rank(s) [1]" in str(failed.value)


def test_replays_leave_a_logged_runs_training_as_it_was(blamed_document, tmp_path):
    plain = run_trainer(tmp_path / "plain", 1, argv("log", *BAD_DOC, rerun=False))
    replayed = run_trainer(tmp_path / "replayed", 1, argv("log", *BAD_DOC), deadline_s=120)
    assert [(r["loss"], r["grad_norm"]) for r in plain] == [
        (r["loss"], r["grad_norm"]) for r in replayed
    ]
    assert spikes_of(tmp_path / "replayed" / "dump")[0]["documents"]


def test_a_run_without_the_named_document_trains_the_rest_alike(blamed_document, tmp_path):
    records, spikes, _ = blamed_document
    skip = tmp_path / "skip.jsonl"
    skip.write_text(
        "".join(
            json.dumps({k: d[k] for k in ("dataset", "document")}) + "\n"
            for d in spikes[0]["documents"]
        )
    )
    got = run_trainer(
        tmp_path, 1, argv("skip", *BAD_DOC, "--training.skip_documents", str(skip)), deadline_s=120
    )
    # the steps before the document's are the same; its step trains without it, unflagged
    assert [r["loss"] for r in got[: STEP - 1]] == [r["loss"] for r in records[: STEP - 1]]
    assert got[STEP - 1]["loss"] != records[STEP - 1]["loss"]
    assert "skipped_steps" not in got[-1]
    assert not (tmp_path / "dump" / "spikes.jsonl").exists()


@pytest.mark.parametrize(
    "line, extra, message",
    [
        (None, [], "no such file"),
        ('{"dataset": "other", "document": 1}', [], "names dataset 'other'"),
        ('{"dataset": "kjv", "document": 1}', ["--training.dataset_streaming"], "indexed source"),
    ],
)
def test_a_bad_skip_file_stops_the_launch(tmp_path, line, extra, message):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    skip = tmp_path / "skip.jsonl"
    if line is not None:
        skip.write_text(line + "\n")
    job = parse_args([*tiny_run(2), "--training.skip_documents", str(skip), *extra])
    with pytest.raises(ConfigError, match=message):
        plan_run(job, 1)
