"""Tied embeddings (Llama 3.2 1B/3B): one matrix for the embedding and the output, counted
once, kept as one parameter under FSDP and TP and as two copies with summed gradients across
pipeline stages; every layout trains like one process; HF round trips both ways."""

import json
import sys

import pytest
import torch

from tests.forked import run_trainer, tiny_run
from titan.components import hf_io
from titan.models.spec import get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

LLAMA = get_train_spec("llama3")
TIED = LLAMA.flavors["debugmodel_tied"].with_updates(vocab_size=2048, max_seq_len=32)
STEPS = 4
COMMON = ["--model.flavor", "debugmodel_tied", *tiny_run(STEPS)]


def built(args, seed=0):
    model = LLAMA.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_one_parameter_counted_once():
    model = built(TIED)
    assert model.output.weight is model.tok_embeddings.weight
    assert TIED.num_params() == sum(p.numel() for p in model.parameters())
    untied = TIED.with_updates(tie_word_embeddings=False)
    assert untied.num_params() - TIED.num_params() == TIED.vocab_size * TIED.dim
    # the output matmul costs the same FLOPs, tied or not
    assert TIED.flops_per_token(32) == untied.flops_per_token(32)
    assert LLAMA.flavors["1B"].tie_word_embeddings and LLAMA.flavors["3B"].tie_word_embeddings
    assert not LLAMA.flavors["8B"].tie_word_embeddings


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_trainer(tmp_path_factory.mktemp("one"), 1, COMMON)


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    # TP shards both roles on the vocabulary dim, and FSDP then shards that one DTensor
    "fsdp2_tp2": (4, ["--parallelism.data_parallel_shard_degree", "2",
                      "--parallelism.tensor_parallel_degree", "2"]),
    # first and last stage on two ranks: the copies' gradients are all-reduced
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    # a V schedule puts both on rank 0: the copies' gradients add locally
    "pp2_zbv": (2, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    "fsdp2_pp2": (4, ["--parallelism.data_parallel_shard_degree", "2",
                      "--parallelism.pipeline_parallel_degree", "2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_like_one_process(layout, one_rank, tmp_path):
    world, flags = LAYOUTS[layout]
    records = run_trainer(tmp_path, world, [*COMMON, *flags], deadline_s=120)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for a, b in zip(one_rank, records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (layout, a, b)


def test_hf_round_trip_keeps_the_tie(tmp_path):
    model = built(TIED, seed=2)
    out = hf_io.save_hf(model.state_dict(), LLAMA, TIED, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    stored = hf_io.load_hf_state(out)
    assert "lm_head.weight" not in stored  # as HF writes a tied model
    assert hf_io.args_from_hf(out, LLAMA, max_seq_len=32) == TIED
    back = hf_io.load_hf(out, LLAMA)
    assert torch.equal(back["tok_embeddings.weight"], model.tok_embeddings.weight)
    assert back["output.weight"] is back["tok_embeddings.weight"]
    reloaded = built(TIED)
    reloaded.load_state_dict(back)
    assert reloaded.output.weight is reloaded.tok_embeddings.weight
    assert torch.equal(reloaded.output.weight, model.output.weight)


def test_transformers_reads_a_tied_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    import warnings

    model = built(TIED, seed=2).eval()
    out = hf_io.save_hf(model.state_dict(), LLAMA, TIED, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.LlamaForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager").eval()
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, TIED.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_model(tokens).logits, rtol=0, atol=1e-5)
    # and back: what transformers writes loads into titan's tied model
    hf_model.save_pretrained(str(tmp_path / "from_hf"))
    back = hf_io.load_hf(tmp_path / "from_hf", LLAMA)
    assert torch.equal(back["output.weight"], model.output.weight)
