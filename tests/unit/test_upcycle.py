"""Dense-to-MoE upcycling (titan.tools.upcycle): the upcycled Qwen3-MoE's first forward is the
dense model's (whole copies, and copies split along their width), noise moves it, bad input is
refused in one line, and the HF folder it writes trains: step 1's loss is the dense model's
on the same batch, on one rank, FSDP 2 and EP 2 alike."""

import logging
import re
import sys

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from titan.components.checkpoint import folders, hf_io
from titan.components.checkpoint.identity import model_identity
from titan.components.checkpoint.train_state import ModelState
from titan.models.spec import get_train_spec
from titan.tools import upcycle

QWEN3 = get_train_spec("qwen3")
SEQ = 64


built = built_model


def saved(tmp_path, family: str, flavor: str, seed: int = 0):
    """A model-only titan checkpoint of `flavor`, as a run's save records it."""
    spec = get_train_spec(family)
    args = spec.flavors[flavor].with_updates(max_seq_len=SEQ)
    path = tmp_path / f"{family}_{flavor}"
    record = model_identity(spec, flavor, args).record()
    folders.save_dcp_model_state(
        ModelState([built(spec, args, seed)]).state_dict(), path, model=record
    )
    return path


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("dense"), "qwen3", "debugmodel", seed=3)


def run_tool(*argv: str) -> None:
    # as `python -m` runs it: no handler that an earlier test in this worker bound to a
    # captured (now closed) stream
    root = logging.getLogger()
    saved, root.handlers = root.handlers, []
    try:
        upcycle.main([str(a) for a in argv])
    finally:
        root.handlers = saved


def loaded_as_training_loads(out):
    """The model of an HF folder as a from_hf run builds and fills it."""
    args = hf_io.args_from_hf(out, QWEN3, max_seq_len=SEQ)
    model = built(QWEN3, args, seed=1)
    state = ModelState([model])
    loaded, _ = hf_io.load_hf_into(state.state_dict(), out, QWEN3, args)
    state.load_state_dict(loaded)
    return model, args


def logits_gap(dense_path, out) -> float:
    dense_model = built(QWEN3, QWEN3.flavors["debugmodel"].with_updates(max_seq_len=SEQ))
    dense_model.load_state_dict(folders.load_dcp_model_state(dense_path), strict=False)
    moe, _ = loaded_as_training_loads(out)
    tokens = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense_model(tokens), moe(tokens)
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    "experts,top_k,granularity",
    [(8, 2, 1), (8, 4, 2), (16, 4, 4)],
    ids=["copies", "halves", "quarters"],
)
def test_the_first_forward_is_the_dense_models(dense, tmp_path, experts, top_k, granularity):
    """Whole copies, and copies split in 2 and 4 along their width (the G slices of a copy
    share a router row, the down projections are scaled by G): the logits of 2 x 64 tokens
    within 1e-5 of the largest, every layer routed sparsely."""
    out = tmp_path / "moe"
    run_tool(
        *("--checkpoint", dense, "--output", out, "--experts", experts, "--top_k", top_k),
        *("--granularity", granularity),
    )
    moe, args = loaded_as_training_loads(out)
    assert [args.is_moe_layer(i) for i in range(args.n_layers)] == [True] * 4
    layer = moe.layers["0"].feed_forward
    assert layer.experts.w1.shape == (experts, 768 // granularity, 256)
    assert args.moe.top_k == top_k < experts and args.moe.norm_topk_prob
    assert logits_gap(dense, out) < 1e-5


def test_noise_moves_the_first_forward(dense, tmp_path):
    run_tool(
        *("--checkpoint", dense, "--output", tmp_path / "moe", "--experts", 8, "--top_k", 2),
        *("--noise", 0.05, "--seed", 1),
    )
    gap = logits_gap(dense, tmp_path / "moe")
    assert 1e-4 < gap < 0.5


@pytest.fixture(scope="module")
def wrong_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wrong")
    return {
        "moe": saved(tmp, "qwen3", "debugmodel_moe"),
        "llama": saved(tmp, "llama3", "debugmodel"),
    }


REFUSALS = {
    "missing": (
        ["--checkpoint", "{tmp}/nowhere", "--experts", 8, "--top_k", 2],
        r"--checkpoint \S+/nowhere: no such folder",
    ),
    "not_dense": (
        ["--checkpoint", "{moe}", "--experts", 8, "--top_k", 2],
        r"holds an MoE model \(8 experts\): upcycling starts from a dense model; pass a dense",
    ),
    "top_k": (
        ["--checkpoint", "{dense}", "--experts", 8, "--top_k", 9],
        r"--top_k 9 must be between 1 and --experts 8",
    ),
    "no_moe_form": (
        ["--checkpoint", "{llama}", "--experts", 8, "--top_k", 2],
        r"llama3 has no mixture-of-experts form to upcycle into; the families that have one: "
        r"(\w+, )*qwen3",
    ),
    "granularity": (
        ["--checkpoint", "{dense}", "--experts", 10, "--top_k", 5, "--granularity", 5],
        r"the FFN width 768 does not split into granularity 5 slices: choose a granularity",
    ),
    "top_k_slices": (
        ["--checkpoint", "{dense}", "--experts", 8, "--top_k", 3, "--granularity", 2],
        r"--top_k 3 is not a multiple of --granularity 2",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_input_is_one_line(case, dense, wrong_models, tmp_path, capsys):
    flags, message = REFUSALS[case]
    where = {"tmp": tmp_path, "dense": dense, **wrong_models}
    with pytest.raises(SystemExit) as e:
        run_tool(*[str(f).format(**where) for f in flags], "--output", tmp_path / "out")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titan.tools.upcycle: "), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out" / "config.json").exists()


def test_an_earlier_output_needs_overwrite(dense, tmp_path, capsys):
    argv = ["--checkpoint", dense, "--output", tmp_path, "--experts", 4, "--top_k", 1]
    run_tool(*argv)
    with pytest.raises(SystemExit):
        run_tool(*argv)
    assert "already holds an HF model: pass --overwrite" in capsys.readouterr().err
    run_tool(*argv, "--overwrite")


# ----------------------------------------------------------------------------- training

STEPS = 3
FROM_HF = ["--model.name", "qwen3", "--model.flavor", "from_hf", *tiny_run(STEPS)]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "ep2": ["--parallelism.expert_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def trained(dense, tmp_path_factory):
    """(the dense run's records, the upcycled folder, its 1-rank run's records)."""
    tmp = tmp_path_factory.mktemp("train")
    dense_run = run_trainer(
        tmp / "dense",
        1,
        ["--model.name", "qwen3", "--model.flavor", "debugmodel", *tiny_run(STEPS)]
        + ["--checkpoint.initial_load_path", str(dense)],
    )
    out = tmp / "moe"
    run_tool("--checkpoint", dense, "--output", out, "--experts", 8, "--top_k", 2)
    argv = [*FROM_HF, "--checkpoint.initial_load_path", str(out), "--checkpoint.initial_load_in_hf"]
    return dense_run, argv, run_trainer(tmp / "one", 1, argv)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_it_trains_from_the_dense_loss(trained):
    dense_run, _, one = trained
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert close(dense_run[0]["loss"], one[0]["loss"]), (dense_run[0], one[0])
    assert "moe_aux_loss" in one[0]  # Qwen's balancing loss, logged apart from the loss
    assert one[-1]["loss"] < one[0]["loss"]


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_it_like_one_rank(trained, layout, tmp_path):
    dense_run, argv, one = trained
    got = run_trainer(tmp_path, 2, [*argv, *LAYOUTS[layout]], deadline_s=150)
    assert close(dense_run[0]["loss"], got[0]["loss"]), (layout, dense_run[0], got[0])
    assert all(close(a["loss"], b["loss"]) for a, b in zip(one, got, strict=True)), (one, got)
