"""Packed data: windows and labels, checkpoint resume, dp sharding, epochs, formats, errors."""

import json
import logging
import re
import time

import pytest
import torch

import titan.components.data.dataset as dataset_mod
from titan.components.data.data_order import GlobalOrder
from titan.components.data.dataloader import (
    DataShard,
    IndexedLoader,
    Workers,
    build_text_dataloader,
)
from titan.components.data.dataset import DataError, local_files
from titan.components.data.packed import MixedWindows, PackedWindows, open_tokens

SEQ = 64


def loader(
    tokenizer,
    local,
    global_,
    rank=0,
    dp=1,
    seed=0,
    dataset="kjv",
    path=None,
    seq_len=SEQ,
    shuffle=True,
    infinite=True,
    text_field="text",
    streaming=False,
    stream_order="rank",
    workers=0,
):
    return build_text_dataloader(
        dataset=dataset,
        dataset_path=path,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local,
        global_batch_size=global_,
        shard=DataShard(dp_rank=rank, dp_world_size=dp),
        seed=seed,
        text_field=text_field,
        shuffle=shuffle,
        infinite=infinite,
        streaming=streaming,
        stream_order=stream_order,
        workers=Workers(workers),
    )


def token_stream(tokenizer, path, text_field="text") -> list[int]:
    """The whole token stream a local source packs its windows from."""
    tokens = open_tokens(local_files("x", str(path)), tokenizer, text_field)
    return tokens.read(0, len(tokens)).tolist()


def xy(batch):
    """(input_ids, labels) of a named batch (a tuple passes as it is)."""
    return (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else batch


def take(dl_or_iter, n):
    it = iter(dl_or_iter)
    return [xy(next(it)) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(map(xy, a), map(xy, b)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


DOCS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
    "And God called the light Day, and the darkness he called Night.",
]


def stream_of(tokenizer, docs):
    return torch.tensor([t for d in docs for t in tokenizer.encode(d)])


# ----------------------------------------------------------------------------- packing


def test_packing_windows_and_labels(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    seq = 8
    stream = stream_of(tokenizer, DOCS)
    n_windows = len(stream) // (seq + 1)
    assert n_windows >= 6
    dl = loader(
        tokenizer, 2, 2, dataset="d", path=str(path), seq_len=seq, shuffle=False, infinite=False
    )
    batches = list(map(xy, dl))
    assert len(batches) == n_windows // 2  # finite mode drops the incomplete global batch
    k = 0
    for x, y in batches:
        assert x.shape == y.shape == (2, seq) and x.dtype == y.dtype == torch.int64
        for row in range(2):
            start = k * (seq + 1)
            assert torch.equal(x[row], stream[start : start + seq])
            assert torch.equal(y[row], stream[start + 1 : start + seq + 1])
            k += 1


def test_kjv_batches_are_shifted(tokenizer):
    for x, y in take(loader(tokenizer, 4, 4), 3):
        assert x.shape == y.shape == (4, SEQ)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < tokenizer.vocab_size


def test_unshuffled_kjv_is_the_token_stream(tokenizer):
    from titan.runtime.paths import resolve

    ((x, y),) = take(loader(tokenizer, 2, 2, shuffle=False), 1)
    with open(resolve(dataset_mod.location_of("kjv"))) as f:
        first_doc = tokenizer.encode(json.loads(f.readline())["text"])
    # consecutive windows are consecutive, non-overlapping stretches of the stream
    whole = torch.cat([x[0], y[0, -1:], x[1], y[1, -1:]])
    assert len(first_doc) > len(whole) == 2 * (SEQ + 1)
    assert whole.tolist() == first_doc[: len(whole)]


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("dp,rank", [(1, 0), (2, 1)])
def test_resume_matches_uninterrupted(tokenizer, dp, rank):
    local, global_ = 4, 4 * dp
    reference = take(loader(tokenizer, local, global_, rank, dp), 7)

    # restore at the very start
    fresh = loader(tokenizer, local, global_, rank, dp)
    state0 = fresh.state_dict()
    restored = loader(tokenizer, local, global_, rank, dp)
    restored.load_state_dict(state0)
    assert_batches_equal(take(restored, 2), reference[:2])

    # restore after a few batches
    first = loader(tokenizer, local, global_, rank, dp)
    it = iter(first)
    assert_batches_equal([next(it) for _ in range(3)], reference[:3])
    state = first.state_dict()
    assert_batches_equal([next(it)], reference[3:4])  # the old loader keeps going unharmed
    resumed = loader(tokenizer, local, global_, rank, dp)
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 4), reference[3:7])


def sequences(batches) -> list[list[int]]:
    return [row.tolist() for x, _ in map(xy, batches) for row in x]


@pytest.mark.parametrize("before,after,dp", [(8, 16, 2), (16, 8, 1), (8, 12, 3)])
def test_resume_onto_another_global_batch_continues_at_the_first_untrained_sequence(
    tokenizer, before, after, dp, caplog
):
    """Saved after 3 global batches of `before`, resumed with global batches of `after` on
    dp ranks: the sequences trained next are the stream's from 3 x `before` on, none skipped
    or repeated, and the log says so."""
    stream = sequences(take(loader(tokenizer, 48, 48), 4))  # the first 192 sequences
    first = loader(tokenizer, before, before)
    take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["stream_position"] == 3 * before and state["global_batch_size"] == before
    ranks = [loader(tokenizer, after // dp, after, rank, dp) for rank in range(dp)]
    with caplog.at_level(logging.INFO, logger="titan.components.data.dataloader"):
        for r in ranks:
            r.load_state_dict(state)
    assert (
        f"the data continues at sequence {3 * before} of the global stream, the first not "
        f"yet trained: the global batch changed from {before} to {after}"
    ) in caplog.text
    iters = [iter(r) for r in ranks]
    resumed = [row for _ in range(3) for it in iters for row in sequences([next(it)])]
    assert resumed == stream[3 * before : 3 * before + 3 * after]
    # ... and a resume of the resumed run continues where that one stopped
    again = loader(tokenizer, after, after)
    again.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    start = 3 * before + 3 * after
    assert sequences(take(again, 1)) == stream[start : start + after]


def test_resume_with_state_through_torch_save(tokenizer, tmp_path):
    reference = take(loader(tokenizer, 2, 2, seed=5), 4)
    dl = loader(tokenizer, 2, 2, seed=5)
    take(dl, 2)
    torch.save(dl.state_dict(), tmp_path / "dl.pt")
    resumed = loader(tokenizer, 2, 2, seed=5)
    resumed.load_state_dict(torch.load(tmp_path / "dl.pt", weights_only=True))
    assert_batches_equal(take(resumed, 2), reference[2:4])


def test_resume_across_epoch_boundary(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    kw = dict(dataset="d", path=str(path), seq_len=8, seed=3)
    reference = take(loader(tokenizer, 3, 3, **kw), 8)  # ~15 windows: crosses an epoch
    dl = loader(tokenizer, 3, 3, **kw)
    take(dl, 5)
    resumed = loader(tokenizer, 3, 3, **kw)
    resumed.load_state_dict(dl.state_dict())
    assert_batches_equal(take(resumed, 3), reference[5:8])


# ----------------------------------------------------------------------------- streaming


def streamed(tokenizer, path, rank=0, dp=1, infinite=True, local=3, text_field="text"):
    return loader(
        tokenizer,
        local,
        local * dp,
        rank,
        dp,
        path=str(path),
        seq_len=8,
        infinite=infinite,
        text_field=text_field,
        streaming=True,
    )


def windows(batches) -> list[int]:
    """The token stream the packed windows were cut from (each window is seq_len + 1)."""
    return [
        t
        for x, y in map(xy, batches)
        for i in range(len(x))
        for t in [x[i, 0].item(), *y[i].tolist()]
    ]


def test_streamed_local_file_is_sharded_per_rank(tokenizer, tmp_path):
    docs = [f"{d} ({i})" for i, d in enumerate(DOCS * 3)]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    for rank in (0, 1):
        stream = windows(list(streamed(tokenizer, path, rank, dp=2, infinite=False)))
        own = [t for d in docs[rank::2] for t in tokenizer.encode(d)]  # every other document
        assert len(stream) > 0.8 * len(own) and stream == own[: len(stream)]


def test_streamed_resume_matches_uninterrupted(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    reference = take(streamed(tokenizer, path, rank=1, dp=2), 9)  # crosses epochs
    for k in (2, 5):
        dl = streamed(tokenizer, path, rank=1, dp=2)
        take(dl, k)
        resumed = streamed(tokenizer, path, rank=1, dp=2)
        # what the checkpoint holds: the dataset's own state, JSON-encoded
        resumed.load_state_dict(json.loads(json.dumps(dl.state_dict())))
        assert_batches_equal(take(resumed, 9 - k), reference[k:])


def test_streamed_validation_pass_ends_and_rewinds(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    dl = streamed(tokenizer, path, infinite=False)
    first = list(dl)
    assert 0 < len(first) < 10
    dl.rewind()
    assert_batches_equal(list(dl), first)
    with pytest.raises(DataError, match="no global index"):
        dl.seek_global_batch(3)


def test_streamed_record_without_text_field(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    with pytest.raises(DataError, match="'text'.*dataset_text_field"):
        take(streamed(tokenizer, path), 1)
    assert take(streamed(tokenizer, path, text_field="body"), 1)


def test_streamed_garbage_is_a_data_error_naming_the_file(tokenizer, tmp_path):
    """Found while reading, by a worker: a DataError, which the launcher does not retry."""
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    path.write_text(path.read_text() + "In the beginning\n")
    with pytest.raises(DataError, match=f"{path}: a record is unreadable .*fix or remove"):
        list(streamed(tokenizer, path, infinite=False))


# ----------------------------------------------------------------------------- dp sharding


def test_dp_sharding_equivalence(tokenizer):
    local, dp, steps = 2, 2, 5
    single = take(loader(tokenizer, local * dp, local * dp), steps)
    ranks = [take(loader(tokenizer, local, local * dp, r, dp), steps) for r in range(dp)]
    for s in range(steps):
        x = torch.cat([ranks[r][s][0] for r in range(dp)])
        y = torch.cat([ranks[r][s][1] for r in range(dp)])
        assert torch.equal(x, single[s][0]) and torch.equal(y, single[s][1])
    # the ranks really read different data
    assert not torch.equal(ranks[0][0][0], ranks[1][0][0])


def test_dp_sharding_with_grad_accumulation(tokenizer):
    local, dp, accum, steps = 2, 2, 4, 3
    global_ = accum * local * dp
    single = take(loader(tokenizer, global_, global_), steps)
    ranks = [take(loader(tokenizer, local, global_, r, dp), steps * accum) for r in range(dp)]
    for s in range(steps):
        # rank r's consecutive microbatches are its contiguous slice of the global batch
        parts = [ranks[r][s * accum + m] for r in range(dp) for m in range(accum)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        assert torch.equal(x, single[s][0]) and torch.equal(y, single[s][1])


def test_global_batch_not_divisible_by_dp_is_refused_when_planned():
    """The layout's plan check refuses it, before any loader is built (the loader checks it
    no more: nothing is checked twice)."""
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args(
        [
            "--training.global_batch_size",
            "5",
            "--training.local_batch_size",
            "1",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ]
    )
    with pytest.raises(ConfigError, match="global_batch_size 5 must be a multiple of"):
        plan_run(job, world_size=2)


# ----------------------------------------------------------------------------- epochs


def test_epoch_wrap(tokenizer, tmp_path, caplog):
    path = write_jsonl(tmp_path / "tiny.jsonl", DOCS)
    seq = 8
    n = len(stream_of(tokenizer, DOCS)) // (seq + 1)
    caplog.set_level(logging.INFO, logger="titan.components.data.data_order")
    samples = take(
        loader(tokenizer, 1, 1, dataset="tiny", path=str(path), seq_len=seq, shuffle=False),
        2 * n + 3,
    )
    assert len(samples) == 2 * n + 3  # kept yielding past the end
    for k in range(n + 3):
        assert torch.equal(samples[n + k][0], samples[k][0])  # unshuffled: same order again
    messages = [r.getMessage() for r in caplog.records]
    assert any("starting epoch 1" in m for m in messages), messages
    assert any("starting epoch 2" in m for m in messages), messages
    assert sum("starting epoch" in m for m in messages) == 2


def test_epoch_reshuffles(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "tiny.jsonl", DOCS * 3)
    seq = 8
    n = len(stream_of(tokenizer, DOCS * 3)) // (seq + 1)
    samples = take(loader(tokenizer, 1, 1, dataset="tiny", path=str(path), seq_len=seq), 2 * n)
    epoch0 = [tuple(s[0][0].tolist()) for s in samples[:n]]
    epoch1 = [tuple(s[0][0].tolist()) for s in samples[n:]]
    assert sorted(epoch0) == sorted(epoch1)  # each epoch sees every window once
    assert len(set(epoch0)) == n
    assert epoch0 != epoch1  # in a new order


# ----------------------------------------------------------------------------- shuffle


def test_shuffle_determinism(tokenizer):
    a = take(loader(tokenizer, 4, 4, seed=1), 3)
    b = take(loader(tokenizer, 4, 4, seed=1), 3)
    c = take(loader(tokenizer, 4, 4, seed=2), 3)
    plain = take(loader(tokenizer, 4, 4, seed=1, shuffle=False), 3)
    assert_batches_equal(a, b)
    assert not torch.equal(a[0][0], c[0][0])
    assert not torch.equal(a[0][0], plain[0][0])


def test_shuffle_is_a_permutation(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 4)
    seq = 8
    kw = dict(dataset="d", path=str(path), seq_len=seq, infinite=False)
    plain = [
        tuple(r.tolist())
        for x, _ in map(xy, loader(tokenizer, 1, 1, shuffle=False, **kw))
        for r in x
    ]
    shuf = [
        tuple(r.tolist())
        for x, _ in map(xy, loader(tokenizer, 1, 1, shuffle=True, **kw))
        for r in x
    ]
    assert sorted(plain) == sorted(shuf) and plain != shuf


# ----------------------------------------------------------------------------- formats


def _first_window(tokenizer, path, seq, **kw):
    dl = loader(tokenizer, 1, 1, dataset="x", path=str(path), seq_len=seq, shuffle=False, **kw)
    return xy(next(iter(dl)))[0][0]


def test_jsonl_file(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    stream = stream_of(tokenizer, DOCS)
    assert torch.equal(_first_window(tokenizer, path, 16), stream[:16])


def test_jsonl_custom_text_field(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS, field="content")
    stream = stream_of(tokenizer, DOCS)
    assert torch.equal(_first_window(tokenizer, path, 16, text_field="content"), stream[:16])
    with pytest.raises(DataError, match="d.jsonl has no field 'text'.*dataset_text_field"):
        _first_window(tokenizer, path, 16)


def test_parquet_file(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), path)
    stream = stream_of(tokenizer, DOCS)
    assert torch.equal(_first_window(tokenizer, path, 16), stream[:16])


def test_txt_file_paragraphs(tokenizer, tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("\n\n".join(DOCS) + "\n")
    tokens = token_stream(tokenizer, path)
    assert tokens.count(tokenizer.bos_id) == len(DOCS)  # one document per paragraph
    text = tokenizer.decode(tokens, skip_special=True)
    for d in DOCS:
        assert d in text


def test_folder_of_files(tokenizer, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", DOCS[:2])
    write_jsonl(folder / "b.jsonl", DOCS[2:])
    assert token_stream(tokenizer, folder) == stream_of(tokenizer, DOCS).tolist()


def test_mixed_formats_rejected(tokenizer, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    (tmp_path / "b.txt").write_text(DOCS[0])
    with pytest.raises(
        DataError,
        match=r"mixes file formats \(\.jsonl, \.txt: e\.g\. a\.jsonl, "
        r"b\.txt\); keep one format per dataset",
    ):
        token_stream(tokenizer, tmp_path)


def test_a_bad_line_deep_in_a_jsonl_file_is_named_by_its_line(tokenizer, tmp_path):
    lines = [json.dumps({"text": f"{DOCS[i % 5]} {i}"}) for i in range(3000)]
    lines[2500] = lines[2500][:-3]  # cut short
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        DataError,
        match=r"d\.jsonl, line 2501: not a JSON record \(.*column "
        r"\d+\); fix or remove that line",
    ):
        token_stream(tokenizer, tmp_path / "d.jsonl")


@pytest.mark.parametrize("name", ["/no/such/valid.jsonl", "./missing", "data/x.parquet"])
def test_a_dataset_named_by_a_missing_path_is_not_looked_up_on_the_hub(name):
    with pytest.raises(
        DataError,
        match=rf"validation\.dataset '{re.escape(name)}' does not "
        r"exist \(a local path, by its form",
    ):
        local_files(name, None, key="validation.dataset_path")
    assert local_files("allenai/c4", None) is None  # a hub name


def test_empty_folder(tokenizer, tmp_path):
    with pytest.raises(DataError, match="holds no"):
        token_stream(tokenizer, tmp_path)


# ----------------------------------------------------------------------------- errors


def test_missing_dataset_path(tokenizer, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as e:
        loader(tokenizer, 1, 1, path=str(missing))
    assert str(missing) in str(e.value) and "training.dataset_path" in str(e.value)


def test_unknown_hub_name_offline(tokenizer, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # the libraries read these at import time: set the env vars and their parsed copies
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    name = "no-such-org-titan-test/no-such-dataset"
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        loader(tokenizer, 1, 1, dataset=name)
    assert time.perf_counter() - t0 < 10, "offline failure must not wait on the network"
    msg = str(e.value)
    assert name in msg and "offline" in msg and "training.dataset_path" in msg
    assert "kjv" in msg  # lists the bundled names


def test_dataset_too_small(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", ["tiny"])
    with pytest.raises(DataError) as e:
        loader(tokenizer, 1, 1, dataset="small", path=str(path), seq_len=64)
    msg = str(e.value)
    assert "fewer than one sequence" in msg and "65" in msg and "training.seq_len" in msg


def test_exactly_one_window(tokenizer):
    tokens = torch.arange(9).numpy()
    order = GlobalOrder(
        [1], [1.0], dp_rank=0, dp_world_size=1, global_batch_size=1, seed=0, shuffle=True
    )
    dl = IndexedLoader(MixedWindows([PackedWindows(tokens, 8)]), order, 1, Workers())
    (x,), (y,) = xy(next(iter(dl)))
    assert x.tolist() == list(range(8)) and y.tolist() == list(range(1, 9))
