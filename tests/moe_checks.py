"""What the MoE families' tests check alike (tests/unit/test_qwen3_moe.py,
tests/unit/test_deepseek_v3.py): a layout trains like one process and moves the routing bias
alike, and a resume is bitwise, the bias included. `one_rank` is (rank 0's metrics records,
the checkpoint folder) of the family's 1-rank run of `argv`."""

import shutil
from dataclasses import dataclass

import torch

from tests.forked import run_trainer
from titan.components.checkpoint import folders as checkpoint


def biases(step_dir) -> dict[str, torch.Tensor]:
    state = checkpoint.load_dcp_model_state(step_dir)
    return {k: v for k, v in state.items() if k.endswith("expert_bias")}


def check_layout_like_one_process(
    one_rank, tmp_path, world: int, argv: list[str], steps: int, moe_layers: int, layout: str
) -> None:
    records = run_trainer(tmp_path, world, argv, deadline_s=150)
    check_run_like_one_process(one_rank, records, tmp_path / "dump", steps, moe_layers, layout)


def check_run_like_one_process(
    one_rank, records: list[dict], dump, steps: int, moe_layers: int, layout: str
) -> None:
    """`records` (rank 0's) and the biases of the step-`steps` checkpoint under `dump`."""
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for a, b in zip(one_rank[0], records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (layout, a, b)
        # the loads of the whole batch, whatever each rank saw of it
        assert a["expert_load_imbalance"] == b["expert_load_imbalance"], (layout, a, b)
        # the balancing loss of the same token groups, whatever ranks split them
        assert ("moe_aux_loss" in a) == ("moe_aux_loss" in b), (layout, a, b)
        if "moe_aux_loss" in a:
            assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-5 * a["moe_aux_loss"], (
                layout,
                a,
                b,
            )
    want = biases(one_rank[1] / f"step-{steps}")
    assert len(want) == moe_layers and all(v.abs().sum() > 0 for v in want.values())
    got = biases(dump / "checkpoint" / f"step-{steps}")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), layout


@dataclass(frozen=True)
class BalancedRun:
    """A MoE family's run that every layout reproduces and a resume continues bitwise: `argv`
    (checkpoints every steps // 2) over `steps`, with `moe_layers` layers of routed experts
    (0: their biases not compared). `one_rank` is its 1-rank run (tests.layouts.one_rank_run)."""

    argv: list[str]
    steps: int
    moe_layers: int = 3

    def check_layout(self, one_rank, tmp_path, layout: str, world: int, flags: list[str]):
        check_layout_like_one_process(
            one_rank, tmp_path, world, [*self.argv, *flags], self.steps, self.moe_layers, layout
        )

    def check_resume(self, one_rank, tmp_path) -> None:
        check_resume_is_bitwise(one_rank, tmp_path, self.argv, self.steps, at=self.steps // 2)


def check_resume_is_bitwise(one_rank, tmp_path, argv: list[str], steps: int, at: int) -> None:
    records, saved = one_rank
    dump = tmp_path / "dump" / "checkpoint"
    shutil.copytree(saved / f"step-{at}", dump / f"step-{at}")
    got = run_trainer(tmp_path, 1, argv)
    assert [r["step"] for r in got] == list(range(at + 1, steps + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [
        (r["loss"], r["grad_norm"]) for r in records[at:]
    ]
    want, back = biases(saved / f"step-{steps}"), biases(dump / f"step-{steps}")
    assert all(torch.equal(back[k], want[k]) for k in want)


def check_hf_round_trip(tmp_path, world: int, argv: list[str], spec, expected: dict) -> list:
    """Each rank of this layout writes the model it holds to one HF folder and reads it back:
    the state read back (rank 0's) and the folder read by one process (as HF tooling would)
    equal `expected`, the one-process model's. Returns each rank's (bytes read, state)."""
    from tests.forked import free_port, run_workers
    from tests.unit.test_hf_sharded import round_trip
    from titan.components.checkpoint import hf_io

    argv = [*argv, "--training.steps", "1", "--job.dump_folder", str(tmp_path / "d")]
    ranks = run_workers(
        round_trip,
        world,
        tmp_path,
        free_port(),
        argv,
        tmp_path / "hf",
        "float32",
        init_pg=False,
        deadline_s=120,
    )
    assert all(torch.equal(ranks[0][1][k], v) for k, v in expected.items())  # read back
    from_folder = hf_io.load_hf(tmp_path / "hf", spec)
    assert all(torch.equal(from_folder[k], v) for k, v in expected.items())
    return ranks
