"""DeepSeek-V3's multi-token prediction: its loss equals the report's equations written out
position by position on the same weights; `loss` stays the main cross-entropy; every layout
trains like one process; the depths cross to and from the hub's layers past the decoder;
generation and validation ignore them; what cannot work is refused before launch."""

import shutil
import sys
import warnings

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import layouts, one_rank_run
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.models.common.aux_loss import AuxLossCollector
from titan.models.common.decoder import TransformerBlock
from titan.models.spec import get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

DEEPSEEK = get_train_spec("deepseek_v3")
SEQ = 32
DEBUG = DEEPSEEK.flavors["debugmodel"].with_updates(max_seq_len=SEQ)
STEPS = 10
DEPTH = ["--deepseek_v3.mtp_depth", "2"]
COMMON = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *tiny_run(STEPS)]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def built(args, seed=0):
    return built_model(DEEPSEEK, args, seed, eval=False)


def row(batch=2, seed=1):
    """Token rows of SEQ + 1: inputs and labels are their two shifts."""
    return torch.randint(
        0, DEBUG.vocab_size, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed)
    )


def rms_norm(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def paper_mtp_loss(model, t: torch.Tensor, depth: int) -> torch.Tensor:
    """The DeepSeek-V3 report's equations (21)-(24), unfused: for each depth k and position i,
    h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})] (the embedding half first, as the
    released eh_proj is laid out), h^k = TRM_k(h'), P_i = softmax(OutHead(h_i^k)), and
    L_k = -1/T sum over the positions with a token t_{i+k+1} in the row of log P_i[t_{i+k+1}];
    the result is the mean of the L_k. h^0 is the main model's normalized output."""
    n, T = model.args.n_layers, t.shape[1] - 1
    with torch.no_grad():
        h = model.tok_embeddings(t[:, :T])
        for i in range(n):
            h = model.layers[str(i)](h, model.rope)
        h = model.norm(h)
        losses = []
        for k in range(1, depth + 1):
            block = model.layers[str(n + k - 1)]
            merged = torch.zeros_like(h)
            for i in range(T):  # positions whose token i+k is in the row (t has T + 1)
                if i + k > T:
                    continue
                e = rms_norm(model.tok_embeddings(t[:, i + k]), block.enorm)
                p = rms_norm(h[:, i], block.hnorm)
                merged[:, i] = torch.cat([e, p], dim=-1) @ block.eh_proj.weight.T
            h = TransformerBlock.forward(block, merged, model.rope)
            log_p = (rms_norm(h, block.head_norm) @ model.output.weight.T).log_softmax(-1)
            total = sum(
                -log_p[b, i, t[b, i + k + 1]]
                for b in range(t.shape[0])
                for i in range(T)
                if i + k + 1 <= T
            )
            losses.append(total / (t.shape[0] * T))
    return sum(losses) / depth


@pytest.mark.parametrize("depth", [1, 2])
def test_the_loss_is_the_report_s_equations(depth):
    model = built(DEBUG.with_updates(mtp_depth=depth), seed=2).train()
    t = row()
    with AuxLossCollector(1.0) as collector:
        model(t[:, :-1], labels=t[:, 1:])
    want = paper_mtp_loss(model, t, depth)
    assert collector.floats()["mtp_loss"] == pytest.approx(want.item(), rel=1e-5)


def test_main_logits_are_the_model_without_prediction_depths():
    """The depths add blocks and a loss, nothing to the main model: same weights (seeded by
    name), same logits, in training and in generation."""
    t = row()
    with torch.no_grad():
        plain = built(DEBUG)(t[:, :-1])
        with_mtp = built(DEBUG.with_updates(mtp_depth=2))
        torch.testing.assert_close(with_mtp(t[:, :-1], labels=t[:, 1:]), plain, rtol=0, atol=0)
    from titan.tools.generate import generate

    prompt = t[0, :7].tolist()
    assert generate(with_mtp.eval(), [prompt], max_new_tokens=8, eos_id=None) == generate(
        built(DEBUG).eval(), [prompt], max_new_tokens=8, eos_id=None
    )


def test_sizes_count_the_depths():
    args = DEBUG.with_updates(mtp_depth=2)
    model = DEEPSEEK.build_meta(args)
    assert list(model.layers) == ["0", "1", "2", "3", "4", "5"]
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    # DeepSeek-V3's published module: 14B, the embedding and head it shares counted again
    # (titan: 11.61B of its own and 2 x 0.93B shared)
    big = DEEPSEEK.flavors["671B"]
    extra = big.with_updates(mtp_depth=1).num_params() - big.num_params()
    shared = 2 * big.vocab_size * big.dim
    assert (extra + shared) / 1e9 == pytest.approx(14.0, abs=0.6)


one_rank = one_rank_run(*COMMON, *DEPTH, *CKPT, steps=STEPS)


LAYOUTS = {
    # tp2:
    # the depths' norms sequence-split, their projection whole on each rank's tokens
    # pp2:
    # the depths on the last stage with their own copy of the embedding
    **layouts("fsdp2", "tp2", "pp2", "ep2"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_like_one_process(layout, one_rank, tmp_path):
    """loss, mtp_loss and grad_norm within 1e-5 (relative) of one process over 10 steps, and
    the last stage's copy of the embedding trained as the first's."""
    world, flags = LAYOUTS[layout]
    records = run_trainer(tmp_path, world, [*COMMON, *DEPTH, *CKPT, *flags], deadline_s=150)
    for a, b in zip(one_rank[0], records, strict=True):
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * a[key], (layout, key, a, b)
    want = checkpoint.load_dcp_model_state(one_rank[1] / f"step-{STEPS}")
    got = checkpoint.load_dcp_model_state(tmp_path / "dump" / "checkpoint" / f"step-{STEPS}")
    assert "mtp_embeddings.weight" not in got  # a tied copy is saved once, as its owner
    for name in ("tok_embeddings.weight", "layers.5.eh_proj.weight", "layers.4.head_norm.weight"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5)


def test_loss_stays_the_main_cross_entropy_and_resume_is_bitwise(one_rank, tmp_path):
    records, saved = one_rank
    off = run_trainer(tmp_path / "off", 1, [*COMMON, "--training.steps", "1"])
    assert off[0]["loss"] == records[0]["loss"] and "mtp_loss" not in off[0]
    assert off[0]["grad_norm"] != records[0]["grad_norm"]
    # at the start a depth's cross-entropy is the main one's, over the (32 - k) / 32 of its
    # positions that have a target
    share = ((32 - 1) + (32 - 2)) / 64
    assert records[0]["mtp_loss"] == pytest.approx(records[0]["loss"] * share, rel=0.02)
    dump = tmp_path / "dump" / "checkpoint"
    shutil.copytree(saved / "step-5", dump / "step-5")
    got = run_trainer(tmp_path, 1, [*COMMON, *DEPTH, *CKPT])
    assert [(r["loss"], r["mtp_loss"]) for r in got] == [
        (r["loss"], r["mtp_loss"]) for r in records[5:]
    ]


@pytest.mark.needs("transformers")
def test_the_depths_cross_to_and_from_the_hub_layout(tmp_path):
    """Exported as layers past the decoder (num_nextn_predict_layers), each with the hub's
    copies of the embedding and head; read back whole; transformers loads the folder (it skips
    those layers) to titan's main logits; a run without MTP skips them."""
    import transformers

    args = DEBUG.with_updates(mtp_depth=1)
    model = built(args, seed=5)
    out = hf_io.save_hf(model.state_dict(), DEEPSEEK, args, tmp_path / "hf")
    names = hf_io.load_hf_state(out)
    for part in ("eh_proj", "enorm", "hnorm", "shared_head.norm", "shared_head.head"):
        assert f"model.layers.4.{part}.weight" in names
    assert torch.equal(names["model.layers.4.embed_tokens.weight"], model.tok_embeddings.weight)
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in names
    assert hf_io.args_from_hf(out, DEEPSEEK, SEQ) == args
    back = hf_io.load_hf(out, DEEPSEEK)
    state = model.state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    without = hf_io.load_hf(out, DEEPSEEK, args=DEBUG)
    assert not any(k.startswith("layers.4.") for k in without)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    t = row()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(t), hf_model(t).logits, rtol=0, atol=1e-4)


def test_context_parallelism_is_refused_before_launch(tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    argv = [*COMMON, *DEPTH, "--parallelism.context_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=r"set deepseek_v3\.mtp_depth = 0 or"):
        plan_run(parse_args([*argv, "--job.dump_folder", str(tmp_path)]), 2)


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_hf_export_and_load_from_sharded_layouts(layout, tmp_path):
    """The last pipeline stage writes the depths with its copy of the embedding, TP ranks their
    shards; the folder and the reloaded model equal the one-process model."""
    from tests.forked import free_port, run_workers
    from tests.unit.test_hf_sharded import round_trip

    world, flags = LAYOUTS[layout]
    argv = [*COMMON, *DEPTH, *flags, "--training.steps", "1"]
    ranks = run_workers(
        round_trip,
        world,
        tmp_path,
        free_port(),
        [*argv, "--job.dump_folder", str(tmp_path / "d")],
        tmp_path / "hf",
        "float32",
        init_pg=False,
        deadline_s=120,
    )
    expected = built(DEBUG.with_updates(mtp_depth=2)).state_dict()
    back = ranks[0][1]
    assert all(torch.equal(back[k], v) for k, v in expected.items() if k in back)
    assert "layers.5.eh_proj.weight" in back or layout == "pp2"
    from_folder = hf_io.load_hf(tmp_path / "hf", DEEPSEEK)
    assert set(from_folder) == set(expected)
    assert all(torch.equal(from_folder[k], v) for k, v in expected.items())
