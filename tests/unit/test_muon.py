"""Muon: its iteration and step as defined (torch.optim.Muon's, for matrices and stacked
experts), the split of parameters between Muon and AdamW, every layout equal to one process,
its state in the planner and the checkpoint, and resume (bitwise, and onto another layout)."""

import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.forked import run_trainer, tiny_run
from tests.layouts import degrees, layouts
from titan.components.checkpoint import disk_space
from titan.components.optim import muon as muon_module
from titan.components.optim.muon import Muon, newton_schulz
from titan.components.optim.optimizer import build_optimizer
from titan.components.optim.registry import save_state_bytes
from titan.config import ConfigError, parse_args
from titan.models.spec import get_train_spec

LLAMA = get_train_spec("llama3")
ARGS = LLAMA.flavors["debugmodel"].with_updates(vocab_size=256, max_seq_len=16)
MUON = ["--optimizer.name", "Muon"]
FP32_NS = ["--muon.ns_dtype", "float32"]


def test_newton_schulz_orthogonalizes_each_matrix():
    g = torch.randn(5, 48, 96, generator=torch.Generator().manual_seed(0))
    x = newton_schulz(g, 5, torch.float32)
    # the quintic's fixed band: singular values pushed into about [0.68, 1.13], not to 1
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.6 and s.max() < 1.2
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = (x * (u @ vh)).sum((-2, -1)) / (x.norm(dim=(-2, -1)) * (u @ vh).norm(dim=(-2, -1)))
    assert cos.min() > 0.95  # the direction of U V^T, the exact orthogonal factor
    # a stack of experts is a batch: each matrix as if alone, bit for bit
    assert all(x[i].equal(newton_schulz(g[i], 5, torch.float32)) for i in range(5))
    tall = newton_schulz(g[0].T, 5, torch.float32)  # rows > cols: iterated on the transpose
    assert torch.allclose(tall, x[0].T, atol=1e-6)


def test_bfloat16_iteration_is_torchs_up_to_rounding():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    theirs = _zeropower_via_newtonschulz(g, muon_module.NS_COEFFICIENTS, 5, 1e-7).float()
    ours = newton_schulz(g, 5, torch.bfloat16)
    # the same iteration: its ~15 bfloat16 roundings (2^-8 each) apart, not a different map
    assert (ours - theirs).norm() / theirs.norm() < 0.05
    assert (newton_schulz(g, 5, torch.float32) - theirs).norm() / theirs.norm() < 0.05


@pytest.mark.parametrize("nesterov,adjust", [(True, "match_rms_adamw"), (False, "original")])
def test_a_step_is_torchs_muon_and_adamw(monkeypatch, nesterov, adjust):
    """Matrices: torch.optim.Muon's step (its iteration run in float32 for the comparison);
    vectors: torch's AdamW, bit for bit."""
    monkeypatch.setattr(
        torch.optim._muon,
        "_zeropower_via_newtonschulz",
        lambda g, coeffs, steps, eps: newton_schulz(g, steps, torch.float32),
    )
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(32, 80, generator=gen), torch.randn(80, generator=gen)
    ours_w, ours_b, ref_w, ref_b = (torch.nn.Parameter(t.clone()) for t in (w, b, w, b))
    ours = Muon(
        [
            {"params": [ours_w], "lr": 1e-2, "weight_decay": 0.1, "muon": True},
            {"params": [ours_b], "lr": 1e-2, "weight_decay": 0.1, "muon": False},
        ],
        betas=(0.9, 0.95),
        eps=1e-8,
        momentum=0.9,
        nesterov=nesterov,
        ns_steps=5,
        ns_dtype=torch.float32,
        adjust_lr=adjust,
    )
    ref_muon = torch.optim.Muon(
        [ref_w], lr=1e-2, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust
    )
    ref_adamw = torch.optim.AdamW(
        [ref_b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )
    for _ in range(3):
        gw, gb = torch.randn(32, 80, generator=gen), torch.randn(80, generator=gen)
        ours_w.grad, ref_w.grad, ours_b.grad, ref_b.grad = gw, gw.clone(), gb, gb.clone()
        for opt in (ours, ref_muon, ref_adamw):
            opt.step()
    assert torch.allclose(ours_w, ref_w, rtol=0, atol=1e-6)
    assert ours_b.equal(ref_b)


def model():
    m = LLAMA.build_meta(ARGS)
    m.to_empty(device="cpu")
    m.init_weights(0)
    return m


def test_hidden_matrices_take_muon_the_rest_adamw():
    job = parse_args(MUON)
    opt = build_optimizer([model()], job.optimizer, job.extensions).optimizers[0]
    muon = {n for g in opt.param_groups if g["muon"] for n in g["param_names"]}
    adamw = {n for g in opt.param_groups if not g["muon"] for n in g["param_names"]}
    assert {"layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight"} <= muon
    assert {
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.0.attention_norm.weight",
    } <= adamw
    assert all("norm" not in n and "tok_embeddings" not in n for n in muon)
    # state: a momentum buffer per matrix, AdamW's moments and step for the rest
    n_muon = sum(p.numel() for g in opt.param_groups if g["muon"] for p in g["params"])
    shapes = [(n, tuple(p.shape)) for n, p in model().named_parameters()]
    n_all = sum(p.numel() for p in model().parameters())
    assert save_state_bytes(shapes, job.optimizer, job.extensions) == (
        4 * n_muon + 8 * (n_all - n_muon) + 4 * len(adamw)
    )


def test_muon_settings_are_checked():
    for argv, key in [
        (["--muon.momentum", "1.0"], "muon.momentum"),
        (["--muon.ns_steps", "0"], "muon.ns_steps"),
        (["--muon.adamw_params", "(output"], "muon.adamw_params"),
        (["--optimizer.state_dtype", "bfloat16"], "optimizer.state_dtype"),
    ]:
        with pytest.raises(ConfigError, match=key):
            parse_args([*MUON, *argv])
    parse_args(["--muon.momentum", "1.0"])  # Muon's section is not checked for AdamW


# ----------------------------------------------------------------------------- training runs

COMMON = [*tiny_run(10), *MUON, *FP32_NS]
LAYOUTS = {
    **layouts("tp2", "pp2"),
    "fsdp2": (2, []),
    "hsdp2x2": (4, [*degrees(data_parallel_replicate=2), "--training.local_batch_size", "2"]),
    "fsdp2_tp2": (4, degrees(tensor_parallel=2)),
}


@pytest.mark.slow("five layouts of 2 and 4 ranks, each rank orthogonalizing every matrix")
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_every_layout_trains_as_one_process(tmp_path):
    """Gathered whole, every matrix is orthogonalized as one process does it: the layouts
    differ by their gradients' reduction order only (AdamW's runs differ by as much)."""
    one = [r["loss"] for r in run_trainer(tmp_path / "one", 1, COMMON, deadline_s=300)]
    assert one[-1] < one[0] - 0.1  # it trains
    for name, (world, extra) in LAYOUTS.items():
        got = [
            r["loss"]
            for r in run_trainer(tmp_path / name, world, [*COMMON, *extra], deadline_s=300)
        ]
        diff = max(abs(a - b) for a, b in zip(one, got, strict=True))
        print(f"{name}: max |loss - 1 rank| over 10 steps {diff:.2e}")
        assert diff < 1e-5, name


@pytest.mark.slow("four 2-rank runs: straight, interrupted, resumed, resumed on TP 2")
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_resume_is_bitwise_and_onto_another_layout(tmp_path):
    ck = ["--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "6"]
    fsdp2 = [*COMMON, *ck]
    straight = run_trainer(tmp_path / "straight", 2, fsdp2)
    run_trainer(tmp_path / "resumed", 2, [*fsdp2, "--training.exit_at_step", "3"])
    step3 = tmp_path / "resumed" / "dump" / "checkpoint" / "step-3"
    # the checkpoint holds what the disk check counts: one buffer per matrix, AdamW's rest
    md = FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    saved = sum(
        m.size.numel() * m.properties.dtype.itemsize
        for k, m in md.items()
        if k.startswith("optimizer.")
    )
    job = parse_args(COMMON)
    weights = [
        (k.removeprefix("model."), tuple(m.size)) for k, m in md.items() if k.startswith("model.")
    ]
    planned = save_state_bytes(weights, job.optimizer, job.extensions)
    assert saved == planned
    assert disk_space.model_save_bytes(model(), job.optimizer, job.extensions) < (
        disk_space.model_save_bytes(model(), parse_args([]).optimizer, {})
    )
    import shutil

    shutil.copytree(tmp_path / "resumed", tmp_path / "tp2")
    resumed = run_trainer(tmp_path / "resumed", 2, fsdp2)
    assert [r["loss"] for r in resumed[-3:]] == [r["loss"] for r in straight[-3:]]
    on_tp2 = run_trainer(tmp_path / "tp2", 2, [*fsdp2, "--parallelism.tensor_parallel_degree", "2"])
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(on_tp2[-3:], straight[-3:]))
    assert diff < 1e-5


# ----------------------------------------------------------------------------- divided iteration


def test_owners_balance_the_iterations_cost():
    from titan.components.optim.muon import _cost, _rounds, owners

    shapes = [torch.Size(s) for s in ((64, 64), (64, 256), (256, 64), (32, 32), (64, 64))]
    owner = owners(shapes, 2)
    load = [sum(_cost(s) for s, o in zip(shapes, owner) if o == r) for r in (0, 1)]
    assert max(load) <= sum(load) - max(load) + max(_cost(s) for s in shapes)  # LPT's bound
    assert owner[1] != owner[2]  # the two costliest apart
    rounds = _rounds(owner, [s.numel() * 4 for s in shapes])
    assert sorted(i for r in rounds for i in r) == list(range(5))
    for r in rounds:  # one matrix of each rank a round: they iterate at once
        assert len({owner[i] for i in r}) == len(r)


def _divided_rank(rank, world_size, shape_2d):
    """Matrices sharded on a 1-D or 2-D mesh: the divided iteration against every rank
    iterating every matrix, and the iterations each rank ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    names = ("dp", "tp") if shape_2d else ("dp",)
    mesh = init_device_mesh("cpu", shape_2d or (world_size,), mesh_dim_names=names)
    placements = [Shard(0), Shard(1)] if shape_2d else [Shard(0)]
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(s, generator=g) for s in ((64, 32), (32, 96), (48, 48), (16, 64), (8, 8))]
    updates = [distribute_tensor(w, mesh, placements) for w in whole]
    updates.append(torch.randn(4, 4, generator=g))  # a replicated parameter: iterated here
    ran = []

    def counted(x, steps, dtype):
        ran.append(tuple(x.shape))
        return newton_schulz(x, steps, dtype)

    muon_module.newton_schulz = counted
    try:
        divided = muon_module.orthogonalized_divided(updates, 5, torch.float32)
        ran_divided = list(ran)
        every = [muon_module.orthogonalized(u, 5, torch.float32) for u in updates]
    finally:
        muon_module.newton_schulz = newton_schulz
    same = all(
        torch.equal(
            d.to_local() if hasattr(d, "to_local") else d,
            e.to_local() if hasattr(e, "to_local") else e,
        )
        for d, e in zip(divided, every)
    )
    return same, ran_divided


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.parametrize("world, shape_2d", [(2, None), (4, (2, 2))])
def test_each_matrix_is_iterated_on_one_rank(tmp_path, world, shape_2d):
    from tests.forked import run_workers

    results = run_workers(_divided_rank, world, tmp_path, shape_2d)
    assert all(same for same, _ in results)  # bitwise every rank iterating every matrix
    split = [r for _, ran in results for r in ran if r != (4, 4)]
    assert sorted(split) == sorted([(64, 32), (32, 96), (48, 48), (16, 64), (8, 8)])
    assert all(ran.count((4, 4)) == 1 for _, ran in results)  # the replicated one: each rank


def test_the_step_time_model_divides_the_iterations():
    from titan.plan.run_plan import plan_run
    from titan.planner.layout_search import Hardware, muon_work, step_time

    job = parse_args([*MUON, "--training.seq_len", "32"])
    plan = plan_run(job, 4)  # FSDP 4: each matrix split over 4 ranks
    (every, gathered), (divided, moved) = (muon_work(job, plan, d) for d in (False, True))
    assert divided == pytest.approx(every / 4) and moved == pytest.approx(2 * gathered)
    assert gathered > 0
    _, parts = step_time(job, plan, Hardware(), 4)
    assert parts["muon"] > 0
