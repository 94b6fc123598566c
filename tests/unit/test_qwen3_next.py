"""Qwen3-Next (model.name = qwen3_next): published sizes; logits, both HF directions and
greedy generation against transformers' Qwen3NextForCausalLM; documents computed as if alone;
every layout, CP included, trains like one process (the routing bias moving alike); resume
bitwise; a folder transformers wrote starts training at its step-1 loss."""

import sys
import warnings

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import degrees, layouts, one_rank_run
from tests.moe_checks import BalancedRun
from tests.unit.test_qwen3 import check_save_pretrained_start
from titan.components.checkpoint import hf_io
from titan.models.common.generation import generate
from titan.models.spec import get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

NEXT = get_train_spec("qwen3_next")
DEBUG = NEXT.flavors["debugmodel"].with_updates(max_seq_len=64)
STEPS = 10
BIAS = ["--qwen3_next.moe_bias_update_rate", "0.01"]
COMMON = ["--model.name", "qwen3_next", "--model.flavor", "debugmodel", *tiny_run(STEPS)]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
RUN = BalancedRun([*COMMON, *BIAS, *CKPT], STEPS)


def built(args, seed=0, spec=NEXT):
    return built_model(spec, args, seed)


def tokens(args, rows=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (rows, args.max_seq_len), generator=gen)


def test_published_total_and_active_sizes():
    """The model card's 80B in total and 3B activated, both rounded to 1B (titan: 79.67B;
    3.25B a token without the embedding and output matrices, 10 of 512 experts)."""
    args = NEXT.flavors["80B-A3B"]
    assert args.num_params() / 1e9 == pytest.approx(80, abs=0.5)
    output = args.vocab_size * args.dim
    active = args.num_params(include_embedding=False, active=True) - output
    assert active / 1e9 == pytest.approx(3, abs=0.5)
    assert [args.is_linear_layer(i) for i in range(8)] == [True, True, True, False] * 2
    small = args.with_updates(n_layers=4)
    assert sum(p.numel() for p in NEXT.build_meta(small).parameters()) == small.num_params()
    assert sum(p.numel() for p in built(DEBUG).parameters()) == DEBUG.num_params()


def test_norms_start_at_scale_one():
    """Zero-centred norms (scale 1 + w) start at w = 0; the linear layers' gated norm is a
    plain one (scale w) at 1."""
    model = built(DEBUG)
    for name, p in model.named_parameters():
        if name.endswith("attention.norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("norm.weight"):
            assert torch.equal(p, torch.zeros_like(p)), name


@pytest.mark.needs("transformers")
def test_logits_both_hf_directions_and_generation_match_transformers(tmp_path):
    model = built(DEBUG, seed=3)
    out = hf_io.save_hf(model.state_dict(), NEXT, DEBUG, tmp_path / "hf")
    names = hf_io.load_hf_state(out)
    assert "model.layers.0.linear_attn.conv1d.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    check_against_transformers(tmp_path, model, DEBUG, NEXT, out, "Qwen3NextForCausalLM")


def check_against_transformers(tmp_path, model, args, spec, folder, hf_class: str) -> None:
    """`folder` (titan's export of `model`) loads in transformers as `hf_class` with equal
    logits and greedy tokens; what transformers saves of it loads back in titan bitwise."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    assert type(hf_model).__name__ == hf_class
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, rtol=0, atol=1e-4)
        # greedy decoding: the linear layers' recurrent and convolution states, the full
        # layers' keys and values, 12 tokens after a 20-token prompt
        prompt = x[:, :20]
        theirs = hf_model.generate(
            prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt)
        )[:, 20:]
    ours = generate(model, prompt.tolist(), max_new_tokens=12, eos_id=None)
    assert ours == theirs.tolist()
    # and back, from what transformers writes (sharded)
    hf_model.save_pretrained(str(tmp_path / "from_hf"), max_shard_size="1MB")
    assert hf_io.args_from_hf(tmp_path / "from_hf", spec, args.max_seq_len) == args
    back = hf_io.load_hf(tmp_path / "from_hf", spec)
    state = model.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_documents_compute_as_if_alone():
    """Block-causal: each document's logits equal the model run on that document alone (the
    linear layers' state and convolution restart at its first token, attention sees its
    own)."""
    model = built(DEBUG, seed=5)
    x = tokens(DEBUG, rows=1)
    doc_ids = torch.zeros_like(x)
    doc_ids[:, 17:] = 1
    doc_ids[:, 40:] = 2
    with torch.no_grad():
        together = model(x, doc_ids=doc_ids)
        for first, end in ((0, 17), (17, 40), (40, 64)):
            alone = model(x[:, first:end])
            torch.testing.assert_close(together[:, first:end], alone, rtol=0, atol=1e-5)


def test_a_padded_batch_decodes_as_each_prompt_alone():
    """Prompts of 9 and 20 tokens in one left-padded batch: the padding enters the linear
    layers as zeros, so each row decodes what it decodes alone."""
    model = built(DEBUG, seed=5)
    x = tokens(DEBUG)
    prompts = [x[0, :9].tolist(), x[1, :20].tolist()]
    together = generate(model, prompts, max_new_tokens=6, eos_id=None)
    alone = [generate(model, [p], max_new_tokens=6, eos_id=None)[0] for p in prompts]
    assert together == alone


one_rank = one_rank_run(*RUN.argv, steps=STEPS)


# 3 MoE layers (layer 0 is dense); the expert loads, balancing loss and biases of every layout
# equal one process's
LAYOUTS = {
    # cp2:
    # the linear layers exchange heads for whole sequences; the attention layer is a ring
    **layouts("fsdp2", "tp2", "tp2_sp", "pp2", "cp2", "cp2_alltoall"),
    "ep2": (2, degrees(data_parallel_shard=2, expert_parallel=2)),
}


@pytest.mark.slow("a 2-rank training of 10 steps")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_like_one_process(one_rank, tmp_path, layout):
    RUN.check_layout(one_rank, tmp_path, layout, *LAYOUTS[layout])


def test_resume_is_bitwise(one_rank, tmp_path):
    RUN.check_resume(one_rank, tmp_path)


def test_documents_train_alike_on_tp2(tmp_path):
    """Block-causal documents under tensor parallelism: the same losses as one process."""
    docs = [*COMMON[:4], *tiny_run(4), "--model.attn_mask_type", "block_causal"]
    one = run_trainer(tmp_path / "one", 1, docs)
    two = run_trainer(tmp_path / "two", 2, [*docs, "--parallelism.tensor_parallel_degree", "2"])
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


def test_documents_train_alike_on_cp2_tp2(tmp_path):
    """Block-causal documents under context parallelism (the linear layers' heads exchanged
    for whole sequences, each split again by TP): the same losses as one process."""
    docs = [*COMMON[:4], *tiny_run(4), "--model.attn_mask_type", "block_causal"]
    one = run_trainer(tmp_path / "one", 1, docs)
    cp_tp = [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    four = run_trainer(tmp_path / "four", 4, [*docs, *cp_tp], deadline_s=200)
    assert [r["loss"] for r in four] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (
            ["--parallelism.context_parallel_degree", "8"],
            8,
            r"context_parallel_degree 8 must divide linear_k_heads 4",
        ),
        (
            [
                "--parallelism.context_parallel_degree",
                "4",
                "--parallelism.context_parallel_type",
                "hybrid",
                "--parallelism.context_parallel_alltoall_degree",
                "2",
            ],
            4,
            r"linear layers need each sequence whole in an all-to-all group",
        ),
    ],
)
def test_context_parallel_layouts_the_linear_layers_cannot_take_are_refused(flags, world, message):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args([*COMMON, *flags])
    with pytest.raises(ConfigError, match=message):
        plan_run(job, world)


@pytest.mark.needs("transformers")
def test_a_save_pretrained_folder_starts_training_at_transformers_loss(tmp_path):
    check_save_pretrained_start(
        tmp_path, "Qwen3NextConfig", "Qwen3NextForCausalLM", DEBUG, family="qwen3_next"
    )
