"""The data path through the real trainer: block-causal attention in every layout, token
shards read by loader workers, and a corpus far larger than memory."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.integration.harness import (
    COMMON,
    FAST,
    STEPS,
    assert_matches_baseline,
    dp_batch,
    launch,
    read_metrics,
    train_layout,
)
from titan.components.data.token_shards import ShardWriter
from titan.components.data.tokenizer import Tokenizer
from titan.runtime.paths import REPO_ROOT

BLOCK = ["--model.attn_mask_type", "block_causal", "--model.document_positions"]


@pytest.fixture(scope="module")
def verses(tmp_path_factory):
    """KJV verses as documents (~40 tokens each: every window holds several), as jsonl and
    as token shards."""
    root = tmp_path_factory.mktemp("verses")
    lines = [
        line
        for doc in open(REPO_ROOT / "assets/corpus/kjv_train.jsonl")
        for line in json.loads(doc)["text"].split("\n")
        if line.strip()
    ][:6000]
    raw = root / "verses.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts/pretokenize.py"),
            str(raw),
            str(root / "shards"),
            "--num-proc",
            "2",
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return raw, root / "shards"


@pytest.fixture(scope="module")
def block_baseline(verses, tmp_path_factory):
    raw, _ = verses
    records = train_layout(
        1,
        [*COMMON, *BLOCK, "--training.dataset_path", str(raw), *dp_batch(1)],
        tmp_path_factory.mktemp("block_baseline"),
    )
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records


CASES = {
    # the same run from the pretokenized shards, fetched by 2 worker processes per rank
    "fsdp2_shards_workers2": (2, ["--training.dataloader_num_workers", "2", *dp_batch(2)], True),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", *dp_batch(1)], False),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", *dp_batch(1)], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_causal_layout_matches_single_process(case, verses, block_baseline, tmp_path):
    raw, shards = verses
    nproc, overrides, from_shards = CASES[case]
    path = shards if from_shards else raw
    assert_matches_baseline(
        block_baseline,
        nproc,
        [*BLOCK, "--training.dataset_path", str(path), *overrides],
        tmp_path,
        case,
    )


@pytest.mark.slow("writes 2 GiB of tokens and trains on them on 2 launched ranks")
def test_corpus_larger_than_memory_keeps_resident_memory_flat(tmp_path):
    """2 GiB of tokens (synthetic) train with the resident memory of the bundled corpus."""
    tok = Tokenizer(str(REPO_ROOT / "assets/tokenizer/tokenizer.json"))
    writer = ShardWriter(tmp_path / "big", tok)
    rng = np.random.default_rng(0)
    chunk = 1 << 26
    for _ in range(16):  # 16 x 64 Mi uint16 tokens = 2 GiB
        writer.add([rng.integers(2, tok.vocab_size, chunk, dtype=np.uint16)])
    big = writer.close()
    size = sum(f.stat().st_size for f in big.glob("*.bin"))
    assert size >= 2 << 30
    run = [
        *FAST,
        "--training.steps",
        "3",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "8",
        "--metrics.no_enable_tensorboard",
    ]
    try:
        launch(2, [*run, "--training.dataset_path", str(big)], tmp_path / "big_run", timeout=300)
        launch(2, [*run, "--training.dataset", "kjv"], tmp_path / "kjv_run", timeout=300)
        mem = {name: read_metrics(tmp_path / f"{name}_run")[-1] for name in ("big", "kjv")}
        mib = {
            name: {k: r[k] * 1024 for k in ("memory_gib", "memory_anon_gib")}
            for name, r in mem.items()
        }
        print(
            f"per rank, 2 GiB corpus vs bundled corpus: anonymous "
            f"{mib['big']['memory_anon_gib']:.0f} vs {mib['kjv']['memory_anon_gib']:.0f} MiB, "
            f"peak RSS {mib['big']['memory_gib']:.0f}"
            f" vs {mib['kjv']['memory_gib']:.0f} MiB"
        )
        # what the process holds itself stays put; mapped shard pages are page cache, which
        # peak RSS counts as they are read (whole folios: ~2 MiB per random window here). A
        # corpus held in memory would add its 2048 MiB; the bound, an eighth of that, sits
        # above the run-to-run spread of two runs' difference (-15 to +67 MiB measured in CI
        # runs on this 2-core VM)
        assert mib["big"]["memory_anon_gib"] <= mib["kjv"]["memory_anon_gib"] + 256, mib
        assert mib["big"]["memory_gib"] <= mib["kjv"]["memory_gib"] + 256, mib
    finally:
        for f in big.glob("*.bin"):
            f.unlink()
