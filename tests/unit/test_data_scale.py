"""Data at scale: token shards (pretokenized and the on-the-fly cache), loader workers,
weighted mixing, streams in global order, and bad data."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.unit.test_data import DOCS, assert_batches_equal, loader, take, write_jsonl
from titan.components.data.data_order import GlobalOrder, WindowPermutation
from titan.components.data.dataloader import DataShard, build_text_dataloader
from titan.components.data.dataset import DataError
from titan.components.data.packed import open_tokens
from titan.components.data.token_shards import ShardWriter, TokenShards
from titan.components.data.tokenizer import Tokenizer
from titan.runtime.paths import REPO_ROOT

SEQ = 32


def pretokenize(*args, check=True):
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "pretokenize.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of two jsonl files, and its pretokenized shards (small shards: a window
    crosses shard boundaries)."""
    root = tmp_path_factory.mktemp("corpus")
    raw = root / "raw"
    raw.mkdir()
    docs = [f"{d} ({i})" for i, d in enumerate(DOCS * 40)]
    write_jsonl(raw / "a.jsonl", docs[:120])
    write_jsonl(raw / "b.jsonl", docs[120:])
    pretokenize(
        raw, root / "shards", "--num-proc", "2", "--batch-size", "16", "--shard-tokens", "1000"
    )
    return raw, root / "shards"


def test_pretokenized_equals_on_the_fly_for_every_dp_degree(tokenizer, corpus):
    raw, shards = corpus
    meta = json.loads((shards / "meta.json").read_text())
    assert len(meta["shards"]) > 3 and meta["dtype"] == "uint16"
    for dp in (1, 2, 4):
        for rank in range(dp):
            kw = dict(local=8 // dp, global_=8, rank=rank, dp=dp, seq_len=SEQ, seed=3)
            assert_batches_equal(
                take(loader(tokenizer, path=str(shards), **kw), 6),
                take(loader(tokenizer, path=str(raw), **kw), 6),
            )


def test_shards_hold_the_documents_in_order(tokenizer, corpus):
    raw, shards = corpus
    tokens = TokenShards(shards, tokenizer)
    docs = [json.loads(line)["text"] for f in sorted(raw.iterdir()) for line in f.open()]
    expected = [t for d in docs for t in tokenizer.encode(d)]
    assert tokens.read(0, len(tokens)).tolist() == expected
    assert tokens.documents == len(docs)
    # a read across shard boundaries
    cut = json.loads((shards / "meta.json").read_text())["shards"][0]["tokens"]
    assert tokens.read(cut - 5, 10).tolist() == expected[cut - 5 : cut + 5]


def test_workers_give_the_same_batches_and_resume_exactly(tokenizer, corpus):
    _, shards = corpus
    kw = dict(local=2, global_=4, rank=1, dp=2, path=str(shards), seq_len=SEQ)
    reference = take(loader(tokenizer, **kw), 10)
    with_workers = loader(tokenizer, workers=2, **kw)
    it = iter(with_workers)
    assert_batches_equal([next(it) for _ in range(4)], reference[:4])
    state = json.loads(json.dumps(with_workers.state_dict()))
    assert state["global_batches"] == 4  # what the trainer took, not what workers fetched
    resumed = loader(tokenizer, workers=2, **kw)
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 6), reference[4:])
    # a jump while iterating (a torchft heal) restarts the workers at the new position
    with_workers.seek_global_batch(8)
    assert_batches_equal([next(it) for _ in range(2)], reference[8:10])


def test_window_permutation_is_a_seeded_bijection():
    for n in (1, 2, 3, 17, 1000, 4099):
        perm = [WindowPermutation(n, seed=5)[i] for i in range(n)]
        assert sorted(perm) == list(range(n))
    a = [WindowPermutation(1000, 1)[i] for i in range(50)]
    assert a != [WindowPermutation(1000, 2)[i] for i in range(50)] and a != list(range(50))


def test_mixing_shares_resume_and_dp_invariance(tokenizer, corpus, tmp_path):
    raw, shards = corpus
    other = write_jsonl(tmp_path / "other.jsonl", [d.upper() for d in DOCS * 30])
    mix = [(str(shards), 0.7), (str(other), 0.3)]

    def mixed(dp=1, rank=0):
        return build_text_dataloader(
            dataset="x",
            dataset_path=None,
            tokenizer=tokenizer,
            seq_len=SEQ,
            local_batch_size=8 // dp,
            global_batch_size=8,
            shard=DataShard(rank, dp),
            seed=1,
            mix=mix,
        )

    one = mixed()
    batches = take(one, 200)
    counts = one.source_tokens(SEQ)
    share = counts[str(shards)] / sum(counts.values())
    assert abs(share - 0.7) < 0.01 and sum(counts.values()) == 200 * 8 * SEQ
    # which source each sequence came from, by its text's case
    upper = sum(
        int(tokenizer.decode(x[i].tolist(), skip_special=True).isupper())
        for x, _ in batches
        for i in range(len(x))
    )
    assert abs(upper / 1600 - 0.3) < 0.01
    two = [mixed(2, r) for r in range(2)]
    its = [iter(dl) for dl in two]
    for step in range(12):
        assert torch.equal(torch.cat([next(it)["input_ids"] for it in its]), batches[step][0])
    state = json.loads(json.dumps(two[0].state_dict()))
    resumed = mixed()
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 5), batches[12:17])
    # onto global batches of 12: the mix continues where the stream stopped
    wider = build_text_dataloader(
        dataset="x",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=SEQ,
        local_batch_size=12,
        global_batch_size=12,
        shard=DataShard(0, 1),
        seed=1,
        mix=mix,
    )
    wider.load_state_dict(state)
    rows = [row for x, _ in take(wider, 4) for row in x]
    assert all(
        torch.equal(a, b)
        for a, b in zip(rows, [r for x, _ in batches[12:18] for r in x], strict=True)
    )
    assert wider.source_tokens(SEQ) == one_counts_after(batches_taken=18, one=mixed())


def one_counts_after(batches_taken: int, one) -> dict[str, int]:
    take(one, batches_taken)
    return one.source_tokens(SEQ)


def test_mix_order_replays_without_saved_counts():
    order = GlobalOrder(
        [50, 7], [0.7, 0.3], dp_rank=0, dp_world_size=1, global_batch_size=8, seed=0, shuffle=True
    )
    first = [x for _, x in zip(range(400), order)]
    fresh = GlobalOrder(
        [50, 7], [0.7, 0.3], dp_rank=0, dp_world_size=1, global_batch_size=8, seed=0, shuffle=True
    )
    fresh.start = 240
    assert [x for _, x in zip(range(160), fresh)] == first[240:]
    assert sum(s for s, _ in first) == 120  # 30% exactly over whole batches of this mix


def test_streamed_global_order_resumes_on_another_dp_degree(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [f"{d} ({i})" for i, d in enumerate(DOCS * 6)])
    kw = dict(path=str(path), seq_len=8, shuffle=False)
    indexed = take(loader(tokenizer, 4, 4, **kw), 12)  # unshuffled: the stream's own order
    two = [
        loader(tokenizer, 2, 4, r, 2, streaming=True, stream_order="global", **kw) for r in range(2)
    ]
    its = [iter(dl) for dl in two]
    for step in range(5):
        assert torch.equal(torch.cat([next(it)["input_ids"] for it in its]), indexed[step][0])
    states = [json.loads(json.dumps(dl.state_dict())) for dl in two]
    assert states[0] == states[1]  # one position for every rank: saved once, as "global"
    one = loader(tokenizer, 4, 4, streaming=True, stream_order="global", **kw)
    one.load_state_dict(states[0])
    assert_batches_equal(take(one, 7), indexed[5:12])  # crosses into the next epoch


def test_shards_of_another_tokenizer_are_refused(tokenizer, corpus, tmp_path):
    _, shards = corpus
    other = tmp_path / "tok"
    other.mkdir()
    data = json.loads((REPO_ROOT / "assets/tokenizer/tokenizer.json").read_text())
    data["model"]["vocab"]["zzz_extra"] = len(data["model"]["vocab"])  # a changed vocabulary
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="written by the tokenizer .* model.tokenizer_path"):
        loader(Tokenizer(str(other)), 1, 1, path=str(shards), seq_len=SEQ)


def test_damaged_shard_folder_is_refused(tokenizer, corpus, tmp_path):
    _, shards = corpus
    copy = tmp_path / "shards"
    copy.mkdir()
    for f in shards.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    last = sorted(copy.glob("*.bin"))[-1]
    last.write_bytes(last.read_bytes()[:-2])
    with pytest.raises(DataError, match=f"{last.name} is .* bytes.*pretokenize"):
        loader(tokenizer, 1, 1, path=str(copy), seq_len=SEQ)


@pytest.mark.parametrize(
    "content,match",
    [
        (b"", r"empty.jsonl holds no records"),
        (
            b'{"text": "fine"}\n{"body": "no text"}\n',
            r"bad.jsonl: record 2 has no text in field 'text'",
        ),
        (b'{"text": "caf\xe9"}\n', r"bad.jsonl, line 1: not a JSON record \(not UTF-8 text\)"),
    ],
)
def test_bad_data_names_file_and_record(tokenizer, tmp_path, content, match):
    name = "empty.jsonl" if not content else "bad.jsonl"
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=match):
        loader(tokenizer, 1, 1, path=str(tmp_path / name), seq_len=SEQ)
    proc = pretokenize(tmp_path / name, tmp_path / "out", check=False)
    assert proc.returncode == 2 and name in proc.stderr
    assert not (tmp_path / "out").exists()


def test_pretokenize_is_the_same_for_any_process_count(tokenizer, corpus, tmp_path):
    raw, shards = corpus
    pretokenize(raw, tmp_path / "one", "--shard-tokens", "1000")
    assert [f.read_bytes() for f in sorted((tmp_path / "one").glob("*.bin"))] == [
        f.read_bytes() for f in sorted(shards.glob("*.bin"))
    ]
    proc = pretokenize(raw, tmp_path / "one", check=False)
    assert proc.returncode == 2 and "exists" in proc.stderr


def test_token_shards_stay_mapped_not_loaded(tokenizer, tmp_path):
    writer = ShardWriter(tmp_path / "big", tokenizer, shard_tokens=1 << 20)
    rng = np.random.default_rng(0)
    for _ in range(8):
        writer.add([rng.integers(2, 1000, 1 << 19)])
    tokens = TokenShards(writer.close(), tokenizer)
    assert len(tokens) == 8 << 19 and len(tokens._maps) == 4
    assert all(isinstance(m, np.memmap) for m in tokens._maps)
    assert open_tokens([tmp_path / "big"], tokenizer, "text").read(5, 3).dtype == np.int64
