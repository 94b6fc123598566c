"""All-to-all context parallelism (parallelism.context_parallel_type = "alltoall", Ulysses):
each rank takes 1/cp of the heads for every token inside attention. Trains to the 1-rank
losses for every family's attention (GQA, q/k norms, MLA, sliding windows with sinks), with
document masks, and composed with FSDP, TP, PP and EP; so does the hybrid (all-to-all inside
groups of ranks); refused where the heads do not divide."""

import sys

import pytest

from tests.forked import run_trainer, run_workers, tiny_run
from tests.unit.test_cp_documents import FAMILIES, corpus  # noqa: F401  (a fixture)
from tests.unit.test_cp_documents import argv as documents_argv
from titan.config import ConfigError, parse_args
from titan.parallelisms.sequence_shard import SequenceShard
from titan.plan.run_plan import plan_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 6
ALLTOALL = ["--parallelism.context_parallel_type", "alltoall"]
CP2 = ["--parallelism.context_parallel_degree", "2", *ALLTOALL]
_ONE_RANK: dict = {}


def one_rank(family, tmp_path_factory, *extra):
    """The 1-rank losses of a family (and extra flags), computed once per module."""
    key = (family, *extra)
    if key not in _ONE_RANK:
        path = tmp_path_factory.mktemp(f"one_{family}")
        _ONE_RANK[key] = run_trainer(path, 1, [*FAMILIES[family], *tiny_run(STEPS), *extra])
    return _ONE_RANK[key]


def assert_close(one, got, what):
    for a, b in zip(one, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (what, a, b)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_alltoall_cp2_trains_like_one_process(family, tmp_path, tmp_path_factory, monkeypatch):
    marker = tmp_path / "heads_in_ran"
    heads_in = SequenceShard.heads_in

    def recorded(self, t):  # the forked ranks inherit it: proof the head split ran
        marker.touch()
        return heads_in(self, t)

    monkeypatch.setattr(SequenceShard, "heads_in", recorded)
    got = run_trainer(tmp_path, 2, [*FAMILIES[family], *tiny_run(STEPS), *CP2], deadline_s=200)
    assert marker.exists()
    assert_close(one_rank(family, tmp_path_factory), got, family)


def _exchange(rank, world_size):
    import torch
    import torch.distributed as dist

    # head-tail load balancing of 8 positions on 2 ranks: rank 0 holds 0, 1, 6, 7
    positions = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]][rank])
    shard = SequenceShard(dist.group.WORLD, positions, by_heads=True)
    heads = torch.arange(4.0)[None, :, None, None]
    t = (10 * heads + positions[None, None, :, None]).expand(1, 4, 4, 3).clone()
    t.requires_grad_(True)
    whole = shard.heads_in(t)
    back = shard.heads_out(whole)
    (back * torch.arange(1.0, 4.0)).sum().backward()
    return (
        whole.detach(),
        torch.equal(back, t),
        torch.equal(t.grad, torch.arange(1.0, 4.0).expand(1, 4, 4, 3)),
    )


def test_heads_in_gives_a_head_group_every_token_in_order(tmp_path):
    import torch

    out = run_workers(_exchange, 2, tmp_path)
    for rank, (whole, round_trip, grad_ok) in enumerate(out):
        expect = 10 * torch.arange(2.0 * rank, 2.0 * rank + 2)[:, None] + torch.arange(8.0)
        assert torch.equal(whole[0, :, :, 0], expect), (rank, whole[0, :, :, 0])
        assert round_trip and grad_ok


LAYOUTS = {
    "fsdp2_cp2": ("llama3", 4, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_cp2": ("qwen3", 4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2_cp2": ("llama3", 4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "ep2_cp2": ("deepseek_v3", 2, ["--parallelism.expert_parallel_degree", "2"]),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_alltoall_composes_with_other_layouts(case, tmp_path, tmp_path_factory):
    family, world, flags = LAYOUTS[case]
    argv = [*FAMILIES[family], *tiny_run(STEPS), *CP2, *flags]
    got = run_trainer(tmp_path, world, argv, deadline_s=300)
    assert_close(one_rank(family, tmp_path_factory), got, case)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_alltoall_with_documents_trains_like_one_process(family, corpus, tmp_path):  # noqa: F811
    one = run_trainer(tmp_path / "one", 1, documents_argv(family, corpus))
    got = run_trainer(tmp_path / "cp", 2, documents_argv(family, corpus, *CP2), deadline_s=200)
    assert_close(one, got, family)


def test_heads_that_do_not_divide_are_refused():
    # GPT-OSS debug: 8 heads, 4 kv heads; tp 2 x cp 4 splits them 8 ways
    job = parse_args(
        [
            *FAMILIES["gpt_oss"],
            *ALLTOALL,
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.tensor_parallel_degree",
            "2",
        ]
    )
    with pytest.raises(ConfigError, match="context_parallel_type") as e:
        plan_run(job, 8)
    assert "4 kv heads" in str(e.value) and "'ring'" in str(e.value)


# the hybrid: all-to-all inside pairs of ranks, a ring of keys and values across the pairs
HYBRID = [
    "--parallelism.context_parallel_degree",
    "4",
    "--parallelism.context_parallel_type",
    "hybrid",
    "--parallelism.context_parallel_alltoall_degree",
    "2",
]


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "gpt_oss"])
def test_hybrid_cp4_trains_like_one_process(family, tmp_path, tmp_path_factory):
    argv = [*FAMILIES[family], *tiny_run(STEPS), *HYBRID]
    got = run_trainer(tmp_path, 4, argv, deadline_s=300)
    assert_close(one_rank(family, tmp_path_factory), got, family)


def test_hybrid_with_documents_trains_like_one_process(corpus, tmp_path):  # noqa: F811
    one = run_trainer(tmp_path / "one", 1, documents_argv("qwen3", corpus))
    got = run_trainer(tmp_path / "cp", 4, documents_argv("qwen3", corpus, *HYBRID), deadline_s=300)
    assert_close(one, got, "qwen3 documents")


# the hybrid composed: 8 ranks (4 for EP, which borrows from cp)
HYBRID_LAYOUTS = {
    "fsdp2_hybrid4": ("llama3", 8, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_hybrid4": ("qwen3", 8, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2_hybrid4": ("llama3", 8, ["--parallelism.pipeline_parallel_degree", "2"]),
    "ep2_hybrid4": ("deepseek_v3", 4, ["--parallelism.expert_parallel_degree", "2"]),
}


@pytest.mark.slow("hybrid CP 4 composed with TP, PP, EP: 8 ranks")
@pytest.mark.parametrize("case", list(HYBRID_LAYOUTS))
def test_hybrid_composes_with_other_layouts(case, tmp_path, tmp_path_factory):
    family, world, flags = HYBRID_LAYOUTS[case]
    argv = [*FAMILIES[family], *tiny_run(STEPS), *HYBRID, *flags]
    got = run_trainer(tmp_path, world, argv, deadline_s=400)
    assert_close(one_rank(family, tmp_path_factory), got, case)


@pytest.mark.parametrize("degree", ["1", "3", "4"])
def test_hybrid_groups_that_do_not_split_cp_are_refused(degree):
    job = parse_args([*HYBRID[:-1], degree])
    with pytest.raises(ConfigError, match="context_parallel_alltoall_degree"):
        plan_run(job, 4)
