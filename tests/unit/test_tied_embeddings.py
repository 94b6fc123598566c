"""Tied embeddings (Llama 3.2 1B/3B): one matrix for the embedding and the output, counted
once, kept as one parameter under FSDP and TP and as two copies with summed gradients across
pipeline stages; every layout trains like one process; HF round trips both ways."""

import json
import shutil
import sys

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import degrees, layouts
from titan.components.checkpoint import hf_io
from titan.models.spec import get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

LLAMA = get_train_spec("llama3")
TIED = LLAMA.flavors["debugmodel_tied"].with_updates(vocab_size=2048, max_seq_len=32)
STEPS = 4
COMMON = ["--model.flavor", "debugmodel_tied", *tiny_run(STEPS)]


def built(args, seed=0):
    return built_model(LLAMA, args, seed, eval=False)


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
    # fsdp2_tp2:
    # TP shards both roles on the vocabulary dim, and FSDP then shards that one DTensor
    # pp2:
    # first and last stage on two ranks: the copies' gradients are all-reduced
    **layouts("fsdp2", "tp2", "fsdp2_tp2", "pp2"),
    # a V schedule puts both on rank 0: the copies' gradients add locally
    "pp2_zbv": (
        2,
        [
            *degrees(pipeline_parallel=2),
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
        ],
    ),
    "fsdp2_pp2": (4, degrees(data_parallel_shard=2, pipeline_parallel=2)),
    # TP's embedding backward makes a whole (Replicate) gradient, the output copy's is
    # sharded: resharded like the weight, the pair sums alike shards (it once aborted)
    "tp2_pp2": (4, degrees(tensor_parallel=2, pipeline_parallel=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_like_one_process(layout, one_rank, tmp_path):
    world, flags = LAYOUTS[layout]
    records = run_trainer(tmp_path, world, [*COMMON, *flags], deadline_s=120)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for a, b in zip(one_rank, records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (layout, a, b)


def test_a_vocabulary_the_ranks_do_not_divide_trains_alike_on_fsdp2_tp2(tmp_path):
    """2051 rows: TP splits them 1026 / 1025, FSDP pads the short shard. The matrix stays one
    parameter in one FSDP unit (TP's styles had made two, and the embedding's unit then
    gathered a copy the optimizer never stepped: step 2 off by 1e-3)."""
    odd = [*COMMON, "--model.tokenizer_path", "assets/tokenizer_chat"]
    one = run_trainer(tmp_path / "one", 1, odd)
    four = run_trainer(tmp_path / "four", 4, [*odd, *LAYOUTS["fsdp2_tp2"][1]], deadline_s=120)
    assert [r["loss"] for r in four] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in four] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)


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


@pytest.mark.needs("transformers")
def test_transformers_reads_a_tied_export(tmp_path):
    import warnings

    import transformers

    model = built(TIED, seed=2).eval()
    out = hf_io.save_hf(model.state_dict(), LLAMA, TIED, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.LlamaForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, TIED.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_model(tokens).logits, rtol=0, atol=1e-5)
    # and back: what transformers writes loads into titan's tied model
    hf_model.save_pretrained(str(tmp_path / "from_hf"))
    back = hf_io.load_hf(tmp_path / "from_hf", LLAMA)
    assert torch.equal(back["output.weight"], model.output.weight)


def _saved_names(step_dir) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


@pytest.mark.slow("seven pipeline runs: straight, saved, four resumes, the former format")
def test_checkpoint_holds_the_tied_matrix_once_and_loads_into_any_layout(
    one_rank, tmp_path, monkeypatch
):
    """Saved by a pipeline (owner on the first stage, copy on the last), the matrix and its
    moments are stored once, under the embedding's name; the run resumes bit for bit, and the
    checkpoint resumes on one rank and on a V schedule (owner and copy on one rank). A
    checkpoint from before (the copy stored too) still loads."""
    ck = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    pp2 = LAYOUTS["pp2"][1]
    straight = run_trainer(tmp_path / "straight", 2, [*COMMON, *pp2])
    run_trainer(tmp_path / "saved", 2, [*COMMON, *pp2, *ck, "--training.exit_at_step", "2"])
    step2 = tmp_path / "saved" / "dump" / "checkpoint" / "step-2"
    names = _saved_names(step2)
    assert {
        "model.tok_embeddings.weight",
        "optimizer.state.tok_embeddings.weight.exp_avg",
        "optimizer.state.tok_embeddings.weight.exp_avg_sq",
    } <= names
    assert not [n for n in names if "output.weight" in n], names
    # the weights alone (convert_to_hf, generate) read as the tied model
    from titan.components.checkpoint import folders as checkpoint
    from titan.config import parse_args
    from titan.tools.generate import load_model

    state = checkpoint.load_dcp_model_state(step2)
    assert "output.weight" not in state
    back = hf_io.load_hf(hf_io.save_hf(state, LLAMA, TIED, tmp_path / "hf"), LLAMA)
    assert torch.equal(back["output.weight"], state["tok_embeddings.weight"])
    model, _ = load_model(step2, parse_args(COMMON), LLAMA, 32, torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, state["tok_embeddings.weight"])

    def resumed(name, world, flags, src=step2):
        dump = tmp_path / name / "dump" / "checkpoint"
        shutil.copytree(src, dump / "step-2")
        return run_trainer(tmp_path / name, world, [*COMMON, *flags, *ck])

    same = resumed("pp2", 2, pp2)
    assert [r["step"] for r in same] == [3, 4]
    assert [r["loss"] for r in same] == [r["loss"] for r in straight[2:]]  # bit for bit
    for name, world, flags in [("one", 1, []), ("zbv", 2, LAYOUTS["pp2_zbv"][1])]:
        got = resumed(name, world, flags)
        for a, b in zip(one_rank[2:], got, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (name, a, b)

    # the former format: every name as is, the copy and its moments too
    from titan.components.checkpoint import train_state
    from titan.components.optim import optimizer

    monkeypatch.setattr(train_state, "saved_form", lambda sd, ties, prefix="": sd)
    monkeypatch.setattr(optimizer, "saved_form", lambda sd, ties, prefix="": sd)
    run_trainer(tmp_path / "old", 2, [*COMMON, *pp2, *ck, "--training.exit_at_step", "2"])
    monkeypatch.undo()
    old = tmp_path / "old" / "dump" / "checkpoint" / "step-2"
    assert "optimizer.state.output.weight.exp_avg" in _saved_names(old)
    # ... whose marker held no model record: the equal pair tells it from an untied model's
    marker = json.loads((old / ".complete").read_text())
    (old / ".complete").write_text(
        json.dumps({k: v for k, v in marker.items() if k not in ("model", "files")})
    )
    got = resumed("from_old", 2, pp2, src=old)
    assert [r["loss"] for r in got] == [r["loss"] for r in straight[2:]]
