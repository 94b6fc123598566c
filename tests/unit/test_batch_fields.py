"""A registered dataset adds batch fields to its samples (the example plugin's `plugin_corpus`:
each token's position within its document), the loader stacks them by name, and a family
that lists a field in `batch_fields` receives it in forward; one that does not never sees it."""

import sys

import pytest
import torch

from tests.example_plugin import FOLDER
from tests.families import gelu_llama
from tests.forked import run_trainer, tiny_run
from titan.components.data import dataset as dataset_mod
from titan.components.data.dataloader import DataShard, build_text_dataloader
from titan.components.data.dataset import DataError
from titan.config import extensions
from titan.models.common.documents import document_ids, document_positions

SEQ = 64


@pytest.fixture(scope="module")
def plugin_corpus():
    module = extensions.import_plugin(str(FOLDER / "data.py"))
    dataset_mod.register_dataset(module.SPEC)  # again, where an earlier test removed it
    yield module.SPEC.name
    dataset_mod.unregister_dataset(module.SPEC.name)


def batches(tokenizer, dataset, n, mix=None, streaming=False):
    loader = build_text_dataloader(
        dataset=dataset,
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=SEQ,
        local_batch_size=8,
        global_batch_size=8,
        shard=DataShard(),
        seed=0,
        shuffle=False,
        streaming=streaming,
        mix=mix,
    )
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("streaming", [False, True], ids=["indexed", "streamed"])
def test_a_datasets_fields_are_stacked_in_its_batches(tokenizer, plugin_corpus, streaming):
    fielded = batches(tokenizer, plugin_corpus, 4, streaming=streaming)
    plain = batches(tokenizer, "kjv", 4, streaming=streaming)
    documents_begun = 0
    for a, b in zip(fielded, plain, strict=True):
        assert set(a) == {"input_ids", "labels", "positions"} and set(b) == {"input_ids", "labels"}
        assert torch.equal(a["input_ids"], b["input_ids"])  # the same windows
        want = document_positions(document_ids(a["input_ids"], tokenizer.bos_id))
        assert a["positions"].shape == (8, SEQ) and torch.equal(a["positions"], want)
        documents_begun += int((a["positions"][:, 1:] == 0).sum())
    assert documents_begun > 0  # some window holds a document's start after its first token


def test_a_mix_whose_sources_add_other_fields_is_refused(tokenizer, plugin_corpus):
    with pytest.raises(DataError, match=r"training.dataset_mix: its sources add different batch"):
        batches(tokenizer, None, 1, mix=[(plugin_corpus, 1.0), ("kjv", 1.0)])


def test_registering_a_taken_dataset_name_is_refused():
    dataset_mod.register_dataset("kjv", "assets/corpus/kjv_train.jsonl")  # the same: a no-op
    with pytest.raises(ValueError, match="a dataset named 'kjv' is already registered"):
        dataset_mod.register_dataset("kjv", "elsewhere.jsonl")


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_only_a_family_that_lists_the_field_reads_it(plugin_corpus, tmp_path):
    """The GELU family lists `positions`: on plugin_corpus (kjv's windows, with positions
    restarting at each document) its losses differ from kjv's, as a window holding a document
    start sees its keys before the start at other distances (~30% of 256-token windows hold
    one; 24 are trained). The debug Llama lists none: its losses are kjv's to the bit, which is
    also what the same windows give where no document starts."""
    gelu_llama.register()
    try:
        runs = {}
        for family in ("gelu", "llama"):
            model = ["--model.name", gelu_llama.NAME, "--model.flavor", "tiny"]
            for data in (plugin_corpus, "kjv"):
                argv = [*tiny_run(3), "--training.dataset", data, "--training.seq_len", "256"]
                argv = [*argv, *model] if family == "gelu" else argv
                records = run_trainer(tmp_path / f"{family}-{data}", 1, argv)
                runs[family, data] = [r["loss"] for r in records]
    finally:
        gelu_llama.unregister()
    assert runs["llama", plugin_corpus] == runs["llama", "kjv"]
    assert runs["gelu", plugin_corpus] != runs["gelu", "kjv"]


def test_the_plan_refuses_such_a_mix_before_any_rank_starts(plugin_corpus):
    from titan.components.data.checks import check_datasets
    from titan.config import ConfigError, parse_args

    job = parse_args(["--training.dataset_mix", f"{plugin_corpus}=1,kjv=1"])
    with pytest.raises(ConfigError, match=r"training.dataset_mix: its sources add different"):
        check_datasets(job)
