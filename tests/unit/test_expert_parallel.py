"""Expert parallelism's dispatch: routed experts sharded over ep ranks, tokens sent to their
experts' ranks and back, equal to one process holding every expert, forward and backward,
also when routing sends most tokens to one rank's experts; the layer's one host read is the
all-to-all's split sizes."""

import sys

import pytest
import torch

from tests.forked import run_workers
from titan.models.common.moe import MoE, MoEArgs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

ARGS = MoEArgs(
    n_experts=8,
    top_k=2,
    hidden_dim=16,
    score_func="sigmoid",
    n_groups=4,
    topk_groups=2,
    route_scale=2.5,
    score_bias=True,
    n_shared_experts=1,
)
DIM, TOKENS = 32, 24


def _moe(seed: int = 0, skew: bool = False) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(DIM, ARGS)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if skew:  # nearly every token picks experts 0 and 1, both on ep rank 0
        moe.router.expert_bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))
    return moe


def _batch() -> torch.Tensor:
    return torch.randn(4, TOKENS // 4 * 2, DIM, generator=torch.Generator().manual_seed(1))


def _reference(skew: bool):
    moe = _moe(skew=skew)
    x = _batch().requires_grad_()
    moe(x).square().sum().backward()
    return x.grad, {n: p.grad for n, p in moe.named_parameters()}, moe(x).detach()


def _ep_rank(rank, world_size, skew):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from titan.parallelisms import expert_parallel
    from titan.parallelisms.expert_parallel import ExpertParallel

    moe = _moe(skew=skew)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    parallelize_module(moe.experts, mesh, ExpertParallel())
    from tests.dispatch_count import DispatchCount

    x = _batch().chunk(world_size)[rank].clone().requires_grad_()
    with torch.profiler.profile() as prof, DispatchCount() as count:
        out = moe(x)
        out.square().sum().backward()
    # the split sizes, read once; nothing else waits for the device (backward reuses them)
    assert count.tolist == 1 and count.host_reads == [], (count.tolist, count.host_reads)
    grads = {
        n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        for n, p in moe.named_parameters()
    }
    spans = [
        e.key
        for e in prof.key_averages()
        if e.key in (expert_parallel.DISPATCH, expert_parallel.COMBINE)
    ]
    return out.detach(), x.grad, grads, sorted(spans)


@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_equals_one_process(ep, skew, tmp_path):
    x_grad, grads, out = _reference(skew)
    ranks = run_workers(_ep_rank, ep, tmp_path, skew, deadline_s=60)

    def close(got, want, what):  # float32 sums in another order: 1e-6 of the largest value
        err = (got - want).abs().max().item()
        assert err <= 1e-6 * want.abs().max().item(), (what, err)

    # the profiler trace shows each rank's dispatch and combine spans
    assert all(r[3] == ["expert_parallel.combine", "expert_parallel.dispatch"] for r in ranks)
    close(torch.cat([r[0] for r in ranks]), out, "output")
    close(torch.cat([r[1] for r in ranks]), x_grad, "input gradient")
    for name, want in grads.items():
        if name.startswith("experts."):
            # each rank holds its experts' whole gradient, divided by ep: data parallelism
            # averages over the ranks holding the same experts, not over ep
            got = torch.cat([r[2][name] for r in ranks]) * ep
        else:  # the rest is replicated: each rank's gradient from its own tokens
            got = sum(r[2][name] for r in ranks)
        close(got, want, name)


@pytest.mark.slow("four runs (1 rank, EP 4, EP 2, 1 rank), each resuming the one before")
def test_a_checkpoint_resumes_on_another_expert_parallel_degree(tmp_path):
    """1 rank -> ep 4 -> ep 2 -> 1 rank, each resuming the checkpoint of the one before (the
    experts resharded by DCP) within 1e-5 of the uninterrupted 1-rank run; and ep 2 resuming
    its own checkpoint bit for bit."""
    import shutil

    from tests.forked import run_trainer, tiny_run

    common = [
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "debugmodel",
        *tiny_run(8),
        "--deepseek_v3.moe_bias_update_rate",
        "0.01",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    four = ["--parallelism.expert_parallel_degree", "4", "--training.local_batch_size", "2"]
    two = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]

    def resume(name, world, flags, source, step):
        shutil.copytree(
            tmp_path / source / "dump" / "checkpoint" / f"step-{step}",
            tmp_path / name / "dump" / "checkpoint" / f"step-{step}",
        )
        got = run_trainer(tmp_path / name, world, [*common, *flags], deadline_s=120)
        assert [r["step"] for r in got] == list(range(step + 1, 9)), name
        return got

    whole = run_trainer(tmp_path / "one", 1, common)
    ep4 = resume("ep4", 4, four, "one", 2)
    ep2 = resume("ep2", 4, two, "ep4", 4)
    back = resume("back", 1, [], "ep2", 6)
    for got in (ep4, ep2, back):
        for b in got:
            a = whole[b["step"] - 1]
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
    again = resume("ep2_again", 4, two, "ep2", 6)
    assert [(r["loss"], r["grad_norm"]) for r in again] == [
        (r["loss"], r["grad_norm"]) for r in ep2[-2:]
    ]


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--parallelism.expert_parallel_degree", "3"],
            r"expert_parallel_degree 3 must be >= 1 and divide data_parallel_shard_degree x "
            r"context_parallel_degree = 4 x 1",
        ),
        (
            [
                "--parallelism.expert_parallel_degree",
                "4",
                "--deepseek_v3.moe_bias_update_rate",
                "0",
                "--model.name",
                "llama3",
                "--model.flavor",
                "debugmodel",
            ],
            r"parallelism\.expert_parallel_degree = 4 .*llama3 debugmodel has none: set it to 1",
        ),
        (
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--fault_tolerance.enable",
                "--deepseek_v3.moe_bias_update_rate",
                "0",
            ],
            r"torchft with expert parallelism is not supported",
        ),
    ],
)
def test_bad_expert_parallel_settings_are_refused_before_launch(flags, message, tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args(
        [
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "debugmodel",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "8",
            *flags,
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    with pytest.raises(ConfigError, match=message):
        plan_run(job, 4)


def test_experts_that_do_not_split_over_ep_are_refused(tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args(
        [
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "debugmodel",
            "--training.local_batch_size",
            "1",
            "--training.global_batch_size",
            "8",
            "--parallelism.expert_parallel_degree",
            "8",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    plan_run(job, 8)  # 8 experts over 8 ranks
    job = parse_args(
        [
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel_moe",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "12",
            "--parallelism.expert_parallel_degree",
            "3",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    with pytest.raises(ConfigError, match=r"the 8 routed experts do not split evenly over 3"):
        plan_run(job, 6)
