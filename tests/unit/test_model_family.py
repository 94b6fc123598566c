"""A model family plugs in without an edit to titan: the test-only GELU Llama
(tests/families/gelu_llama.py), built on titan/models/common only, trains under FSDP 2, TP 2
and PP 2 to the 1-rank losses, with an auxiliary loss that backward sees (under a pipeline
too) and that is logged apart from `loss`, a post-optimizer-step hook, and a config section
of its own; its checkpoint exports to HF and back through its own adapter."""

import json
import sys

import pytest
import torch

from tests.families import gelu_llama
from tests.forked import build_trainer, free_port, run_trainer, run_workers
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.config import parse_args
from titan.models import spec as spec_registry
from titan.plan.run_plan import plan_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 6
COMMON = [
    "--model.name",
    gelu_llama.NAME,
    "--model.flavor",
    "tiny",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.mixed_precision_param",
    "float32",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "5e-3",
    "--metrics.log_freq",
    "1",
    "--metrics.no_enable_tensorboard",
    "--metrics.peak_flops",
    "1e12",
    "--gelu_llama.aux_loss_coeff",
    "0.5",
]
AUX = "activation_l2"


@pytest.fixture(scope="module")
def family():
    gelu_llama.register()
    yield spec_registry.get_train_spec(gelu_llama.NAME)
    gelu_llama.unregister()


@pytest.fixture(scope="module")
def one_rank(family, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    records = run_trainer(
        tmp,
        1,
        [
            *COMMON,
            "--training.local_batch_size",
            "8",
            "--checkpoint.enable",
            "--checkpoint.last_save_model_only",
        ],
    )
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3  # it learns
    return records, tmp / "dump" / "checkpoint" / f"step-{STEPS}"


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
        ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"],
        # the aux loss of the first stage's layers reaches backward through the stage's output
        ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"],
    ],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_trains_like_one_rank(layout, one_rank, tmp_path):
    records = run_trainer(tmp_path, 2, [*COMMON, *layout])
    for a, b in zip(one_rank[0], records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
        assert abs(a[AUX] - b[AUX]) <= 1e-5 * a[AUX], (a, b)


def test_the_aux_loss_trains_and_is_logged_apart(one_rank, tmp_path):
    """`loss` is the cross-entropy alone: equal at step 1 with and without the aux loss,
    apart after (backward saw the aux loss), and the aux value has its own key."""
    plain = run_trainer(
        tmp_path,
        1,
        [*COMMON, "--gelu_llama.aux_loss_coeff", "0", "--training.local_batch_size", "8"],
    )
    with_aux = one_rank[0]
    assert plain[0]["loss"] == with_aux[0]["loss"] and AUX not in plain[0]
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(plain[1:], with_aux[1:]))
    assert with_aux[0][AUX] > 0
    # the aux loss pulls the MLP inputs' mean square down faster than cross-entropy alone
    assert with_aux[-1][AUX] < with_aux[0][AUX]


def _hook_calls(rank, world_size, port, argv):
    trainer = build_trainer(rank, world_size, port, argv)
    try:
        trainer.train()
    finally:
        trainer.close()
    return [int(part.optimizer_steps) for part in trainer.model_parts]


def test_post_optimizer_hook_runs_after_every_step_taken(family, tmp_path):
    argv = [
        *COMMON,
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "3",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "dump"),
    ]
    assert run_workers(_hook_calls, 2, tmp_path, free_port(), argv, init_pg=False) == [[3], [3]]


def test_family_options_are_checked_like_any_other(family):
    from titan.config import ConfigError
    from titan.config.manager import help_text

    job = parse_args(COMMON)
    assert job.gelu_llama.aux_loss_coeff == 0.5
    assert plan_run(job, world_size=1).model_args.aux_loss_coeff == 0.5
    assert "--gelu_llama.aux_loss_coeff" in help_text()
    with pytest.raises(ConfigError, match="did you mean 'gelu_llama.aux_loss_coeff'"):
        parse_args([*COMMON, "--gelu_llama.aux_los_coeff", "1"])
    with pytest.raises(ConfigError, match=r"aux_loss_coeff = 'big' \(from command line"):
        parse_args([*COMMON, "--gelu_llama.aux_loss_coeff", "big"])


def test_exports_to_hf_through_its_adapter(family, one_rank, tmp_path):
    state = checkpoint.load_dcp_model_state(one_rank[1])
    assert "layers.0.feed_forward.fc_in.weight" in state  # the family's own parameters
    args = plan_run(parse_args(COMMON), world_size=1).model_args
    out = hf_io.save_hf(state, family, args, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == gelu_llama.NAME and config["hidden_act"] == "gelu"
    raw = hf_io.load_hf_state(out)
    assert "model.layers.3.mlp.fc_out.weight" in raw and "lm_head.weight" in raw
    back = hf_io.load_hf(out, family)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert family.matching_flavor(hf_io.args_from_hf(out, family)) == "tiny"
