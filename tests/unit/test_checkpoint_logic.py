"""Checkpoint bookkeeping without a training run: completeness checks, encodings, data state."""

import json

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from titan.components.checkpoint.folders import folder_problem, saved_keys
from titan.components.checkpoint.train_state import DataState, decode_json, encode_json
from titan.components.data.data_order import GlobalOrder
from titan.components.data.dataloader import IndexedLoader, Workers
from titan.components.data.packed import MixedWindows, PackedWindows
from titan.components.optim.lr_scheduler import build_lr_scheduler
from titan.components.optim.lr_scheduler_spec import LRScheduler


def _write(path, marker=True):
    dcp.save(
        {"model": {"w": torch.arange(1000.0)}, "train_state": {"step": torch.tensor(3)}},
        checkpoint_id=str(path),
        no_dist=True,
    )
    if marker:
        (path / ".complete").write_text(json.dumps({"step": 3}))


def test_problem_detects_each_kind_of_damage(tmp_path):
    good = tmp_path / "good"
    _write(good)
    assert folder_problem(good) is None
    assert saved_keys(good) == {"model", "train_state"}

    torn = tmp_path / "torn"
    _write(torn, marker=False)
    assert folder_problem(torn).startswith("incomplete")

    trunc = tmp_path / "trunc"
    _write(trunc)
    shard = next(trunc.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert folder_problem(trunc).startswith("truncated file")

    missing = tmp_path / "missing"
    _write(missing)
    next(missing.glob("*.distcp")).unlink()
    assert folder_problem(missing).startswith("missing file")

    bad_meta = tmp_path / "bad_meta"
    _write(bad_meta)
    (bad_meta / ".metadata").write_bytes(b"not metadata")
    assert folder_problem(bad_meta).startswith("unreadable metadata")


def test_json_state_round_trips_as_uint8_tensor():
    state = {"ds": {"shard": 3, "pos": [1, 2]}, "buffer": [5, 6, 7], "epoch": 2}
    t = encode_json(state)
    assert t.dtype == torch.uint8 and t.dim() == 1
    assert decode_json(t) == state


def _packed(dp_rank, dp, global_batch=8):
    windows = PackedWindows(np.arange(10_000), seq_len=15)
    order = GlobalOrder(
        [len(windows)],
        [1.0],
        dp_rank=dp_rank,
        dp_world_size=dp,
        global_batch_size=global_batch,
        seed=0,
        shuffle=True,
    )
    return IndexedLoader(MixedWindows([windows]), order, 1, Workers())


def test_data_position_is_layout_independent():
    # 3 steps on 4 dp ranks, then resume on 2 dp ranks: the next global batch is the same
    four = [_packed(r, 4) for r in range(4)]
    for ds in four:
        it = iter(ds)
        for _ in range(3 * 2):
            next(it)
    saved = DataState(four[0], dp_rank=0).state_dict()
    assert set(saved) == {"global"}
    two = [_packed(r, 2) for r in range(2)]
    for r, ds in enumerate(two):
        DataState(ds, dp_rank=r).load_state_dict(saved)
    one = _packed(0, 1)
    it = iter(one)
    for _ in range(3 * 8):
        next(it)
    expected = [next(it)["input_ids"][0] for _ in range(8)]
    resumed = []
    for ds in two:
        it = iter(ds)
        resumed += [next(it)["input_ids"][0] for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed, strict=True))


LINEAR = LRScheduler(warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)


def test_lr_scheduler_state_is_one_integer():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_scheduler(opt, LINEAR, 10)
    for _ in range(4):
        sched.step()
    sd = sched.state_dict()
    assert list(sd) == ["steps_done"] and int(sd["steps_done"]) == 4
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_lr_scheduler(opt2, LINEAR, 10)
    sched2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_checkpoint_saved_on_cpu_resumes_on_a_gpu_and_back(tmp_path, monkeypatch, caplog):
    """A CPU checkpoint holds no CUDA RNG state; a GPU run's template asks for one. The
    GPU is stood in for by torch.cuda's RNG functions (the load path calls nothing else)."""
    from titan.components.checkpoint.checkpointer import Checkpointer
    from titan.components.checkpoint.train_state import TrainState

    cpu_ckpt = tmp_path / "cpu"
    saved = TrainState()
    saved.step, saved.tokens_seen = 7, 700
    dcp.save({"train_state": saved}, checkpoint_id=str(cpu_ckpt), no_dist=True)

    cuda_rng = {"state": torch.full((16,), 5, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_rng["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t: cuda_rng.update(state=t.clone()))

    on_gpu = TrainState()
    with caplog.at_level("WARNING"):
        Checkpointer._dcp_load(None, {"train_state": on_gpu}, cpu_ckpt)
    assert (on_gpu.step, on_gpu.tokens_seen) == (7, 700)
    assert "holds no CUDA RNG state" in caplog.text
    assert on_gpu.saved_keys is None  # a later save writes the CUDA state again
    assert "rng_cuda" in on_gpu.state_dict()

    gpu_ckpt = tmp_path / "gpu"  # and a GPU checkpoint restores the CUDA generator
    dcp.save({"train_state": on_gpu}, checkpoint_id=str(gpu_ckpt), no_dist=True)
    cuda_rng["state"] = torch.zeros(16, dtype=torch.uint8)
    Checkpointer._dcp_load(None, {"train_state": TrainState()}, gpu_ckpt)
    assert cuda_rng["state"].tolist() == [5] * 16

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    on_cpu = TrainState()  # the GPU checkpoint on CPU: its CUDA state is left unread
    Checkpointer._dcp_load(None, {"train_state": on_cpu}, gpu_ckpt)
    assert on_cpu.step == 7
