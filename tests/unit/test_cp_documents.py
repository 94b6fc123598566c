"""Context parallelism with packed documents (block-causal masks, with and without positions
restarting at each document): each rank's queries against every rank's keys, masked by
document and position, train to the 1-rank losses for every family's attention (GQA, q/k
norms, MLA, sliding windows with sinks), on documents both longer and shorter than a rank's
chunk."""

import json
import sys

import pytest

from tests.forked import run_trainer, tiny_run
from titan.components.data.tokenizer import Tokenizer
from titan.runtime.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 6
SEQ = 64
FAMILIES = {
    "llama3": ["--model.name", "llama3", "--model.flavor", "debugmodel"],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel"],
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
    "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 2 to 70 words: in 64-token windows, some end inside a rank's chunk of
    8 or 16 tokens, some span several chunks and windows."""
    first = (REPO_ROOT / "assets" / "corpus" / "kjv_train.jsonl").open().readline()
    text = json.loads(first)["text"].split()
    rows, at = [], 0
    for n in [2, 5, 70, 3, 9, 40, 1, 12, 25, 4, 60, 7] * 40:
        rows.append({"text": " ".join(text[at % 500 : at % 500 + n])})
        at += n
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def argv(family, corpus, *extra):
    return [
        *FAMILIES[family],
        *tiny_run(STEPS),
        "--training.seq_len",
        str(SEQ),
        "--training.dataset",
        str(corpus),
        "--model.attn_mask_type",
        "block_causal",
        *extra,
    ]


def test_the_corpus_packs_documents_of_mixed_lengths(corpus):
    tok = Tokenizer(str(REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"))
    lengths = [len(tok.encode(json.loads(r)["text"])) for r in corpus.read_text().splitlines()]
    assert min(lengths) < 8 and max(lengths) > SEQ


CASES = {
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "cp4_positions": (
        4,
        ["--parallelism.context_parallel_degree", "4", "--model.document_positions"],
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(CASES))
def test_cp_with_documents_trains_like_one_process(family, case, corpus, tmp_path):
    world, flags = CASES[case]
    extra = ["--model.document_positions"] if "positions" in case else []
    one = run_trainer(tmp_path / "one", 1, argv(family, corpus, *extra))
    got = run_trainer(tmp_path / "cp", world, argv(family, corpus, *flags), deadline_s=200)
    for a, b in zip(one, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (family, case, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, b)


def test_the_documents_change_what_is_trained(corpus, tmp_path):
    """The masks matter on this corpus: block-causal and plain causal attention train apart."""
    causal = run_trainer(
        tmp_path / "c", 1, argv("llama3", corpus, "--model.attn_mask_type", "causal")
    )
    docs = run_trainer(tmp_path / "d", 1, argv("llama3", corpus))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(causal, docs)) > 1e-3
