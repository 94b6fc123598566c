"""A second model family plugs in without an edit to titan: the test-only GELU Llama
(tests/families/gelu_llama.py) trains under FSDP 2 and TP 2 to the 1-rank losses, and its
checkpoint exports to HF and back through its own adapter."""

import json
import sys

import pytest
import torch

from tests.families import gelu_llama
from tests.forked import run_trainer
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.config import parse_args
from titan.models import spec as spec_registry
from titan.preflight import plan_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 6
COMMON = ["--model.name", gelu_llama.NAME, "--model.flavor", "tiny",
          "--training.steps", str(STEPS), "--training.seq_len", "64",
          "--training.mixed_precision_param", "float32", "--training.deterministic",
          "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "5e-3", "--metrics.log_freq", "1",
          "--metrics.no_enable_tensorboard", "--metrics.peak_flops", "1e12"]


@pytest.fixture(scope="module")
def family():
    gelu_llama.register()
    yield spec_registry.get_train_spec(gelu_llama.NAME)
    spec_registry._REGISTRY.pop(gelu_llama.NAME)


@pytest.fixture(scope="module")
def one_rank(family, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    records = run_trainer(tmp, 1, [*COMMON, "--training.local_batch_size", "8",
                                   "--checkpoint.enable", "--checkpoint.last_save_model_only"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3  # it learns
    return records, tmp / "dump" / "checkpoint" / f"step-{STEPS}"


@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
    ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"],
], ids=["fsdp2", "tp2"])
def test_trains_like_one_rank(layout, one_rank, tmp_path):
    records = run_trainer(tmp_path, 2, [*COMMON, *layout])
    for a, b in zip(one_rank[0], records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]


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
