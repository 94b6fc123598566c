"""Per-op selective activation checkpointing under context parallelism keeps what attention
computed: the exchanges of q, k, v and outputs (all-to-all), and the attention itself (SDPA,
torch's ring attention, titan's ring attention with masks, the written-out masked attention,
each one op) run once a step, as with no checkpointing at all, while full checkpointing runs
them again in recompute. Losses equal the uncheckpointed run's."""

import json
import sys

import pytest

from tests.dispatch_count import DispatchCount
from tests.forked import run_trainer, tiny_run
from tests.unit.test_cp_documents import FAMILIES, corpus  # noqa: F401  (a fixture)
from tests.unit.test_cp_documents import argv as documents_argv
from titan.trainer.train import Trainer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 2
# what recompute must not run again: the exchanges, and attention in each of its forms
KEPT = (
    "titan.cp_all_to_all",
    "titan.cp_all_gather",
    "titan.masked_attention",
    "titan.ring_masked_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
)


def _counted(tmp_path, monkeypatch, argv, ac):
    """Rank 0's count of each KEPT op over the run's steps, and its losses."""
    out = tmp_path / ac
    out.mkdir()
    train_step = Trainer.train_step

    def counted(self, *args):  # the forked ranks inherit it
        with DispatchCount() as mode:
            result = train_step(self, *args)
        if self.rank == 0:
            with open(out / "counts.jsonl", "a") as f:
                f.write(json.dumps({k: mode.ops[k] for k in KEPT}) + "\n")
        return result

    monkeypatch.setattr(Trainer, "train_step", counted)
    mode = ["--activation_checkpoint.mode", ac]
    if ac == "selective":
        mode += ["--activation_checkpoint.selective_ac_option", "op"]
    records = run_trainer(out, 2, [*argv, *mode], deadline_s=240)
    steps = [json.loads(line) for line in (out / "counts.jsonl").read_text().splitlines()]
    assert len(steps) == STEPS
    return {k: sum(s[k] for s in steps) for k in KEPT}, [r["loss"] for r in records]


CASES = {
    "alltoall": lambda docs: [
        *FAMILIES["llama3"],
        *tiny_run(STEPS),
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_type",
        "alltoall",
    ],
    "ring_documents": lambda docs: [
        *documents_argv("qwen3", docs, "--parallelism.context_parallel_degree", "2"),
        "--training.steps",
        str(STEPS),
    ],
    "alltoall_sinks": lambda docs: [
        *FAMILIES["gpt_oss"],
        *tiny_run(STEPS),
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_type",
        "alltoall",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_selective_ac_keeps_attention_and_its_exchanges(case, corpus, tmp_path, monkeypatch):  # noqa: F811
    argv = CASES[case](corpus)
    none, none_losses = _counted(tmp_path, monkeypatch, argv, "none")
    full, _ = _counted(tmp_path, monkeypatch, argv, "full")
    sac, sac_losses = _counted(tmp_path, monkeypatch, argv, "selective")
    assert any(none.values()), none  # the case runs some of them
    # recompute is counted (what runs outside the blocks, e.g. the document ids' gather, is
    # not recomputed by any mode)
    assert all(full[k] >= none[k] for k in KEPT) and full != none, (none, full)
    assert sac == none, (none, sac)
    for a, b in zip(none_losses, sac_losses, strict=True):
        assert abs(a - b) <= 1e-6 * a, (none_losses, sac_losses)
