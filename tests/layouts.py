"""The layouts the tests train, by name: (ranks, trainer flags). A test picks those that apply
to what it checks (`layouts(...)`) and compares each with its one-process run; one table, so
that a layout means the same everywhere."""

import pytest


def degrees(**degree: int) -> list[str]:
    """`degrees(tensor_parallel=2)` -> ["--parallelism.tensor_parallel_degree", "2"]."""
    return [f for k, v in degree.items() for f in (f"--parallelism.{k}_degree", str(v))]


_HSDP = [
    *degrees(data_parallel_replicate=2, data_parallel_shard=2),
    "--training.local_batch_size",
    "2",
]

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "fsdp2": (2, degrees(data_parallel_shard=2)),
    "hsdp2x2": (4, _HSDP),
    "tp2": (2, degrees(tensor_parallel=2)),
    "tp2_sp": (2, [*degrees(tensor_parallel=2), "--parallelism.enable_sequence_parallel"]),
    "tp2_no_sp": (2, [*degrees(tensor_parallel=2), "--parallelism.no_enable_sequence_parallel"]),
    "pp2": (2, degrees(pipeline_parallel=2)),
    "cp2": (2, degrees(context_parallel=2)),
    "cp2_alltoall": (
        2,
        [*degrees(context_parallel=2), "--parallelism.context_parallel_type", "alltoall"],
    ),
    "cp2_no_load_balance": (
        2,
        [*degrees(context_parallel=2), "--parallelism.no_context_parallel_load_balance"],
    ),
    "fsdp2_tp2": (4, degrees(data_parallel_shard=2, tensor_parallel=2)),
    "ep2": (2, degrees(expert_parallel=2)),
    "compile": (1, ["--compile.enable"]),
}


def layouts(*names: str, **own: tuple[int, list[str]]) -> dict[str, tuple[int, list[str]]]:
    """The shared layouts `names`, then a test's `own` (a layout only it trains)."""
    return {**{name: LAYOUTS[name] for name in names}, **own}


def one_rank_run(*argv: str, steps: int | None = None):
    """A module-scoped fixture: the one-process run of `argv` that a module's layouts are
    compared with, as (records, its checkpoint folder)."""
    from tests.forked import run_trainer

    @pytest.fixture(scope="module")
    def one_rank(tmp_path_factory):
        tmp = tmp_path_factory.mktemp("one")
        records = run_trainer(tmp, 1, list(argv))
        if steps is not None:
            assert [r["step"] for r in records] == list(range(1, steps + 1))
        return records, tmp / "dump" / "checkpoint"

    return one_rank
