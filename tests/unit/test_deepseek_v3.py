"""DeepSeek-V3: published total and active sizes; logits (MLA, YaRN, sigmoid group routing
with a correction bias, shared experts, dense first layers) and both HF directions against
transformers' DeepseekV3ForCausalLM; every layout trains like one process with the bias
moving, and moves it alike; resume is bitwise; the sequence-wise balance loss; generation."""

import json
import sys
import warnings

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import degrees, layouts, one_rank_run
from tests.moe_checks import (
    BalancedRun,
    check_hf_round_trip,
    check_layout_like_one_process,
    check_run_like_one_process,
)
from tests.unit.test_qwen3 import check_save_pretrained_start
from titan.components.checkpoint import hf_io
from titan.models.deepseek_v3.state_dict_adapter import deepseek_v3_args_from_hf_config
from titan.models.spec import family_of_hf_config, get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

DEEPSEEK = get_train_spec("deepseek_v3")
DEBUG = DEEPSEEK.flavors["debugmodel"].with_updates(max_seq_len=64)
STEPS = 10
# the flavor's sequence-wise balance loss (0.0001) and the bias update at a rate that moves
# the routing within a few steps: what every layout must reproduce exactly
BIAS = ["--deepseek_v3.moe_bias_update_rate", "0.01"]
COMMON = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *tiny_run(STEPS)]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
RUN = BalancedRun([*COMMON, *BIAS, *CKPT], STEPS)

# (total, active) parameters in billions as published, and how close titan's count must be:
# DeepSeek-V3 671B / 37B (without its 14B multi-token-prediction module; titan: 671.03 /
# 37.55), Moonlight-16B-A3B 16B / 3B, rounded to the billion (titan: 15.96 / 2.91)
PUBLISHED = {"671B": (671.0, 37.0, 0.6), "16B": (16.0, 3.0, 0.1)}


def built(args, seed=0, bias_seed=None):
    model = built_model(DEEPSEEK, args, seed, eval=False)
    if bias_seed is not None:  # a routing bias that changes the choice of some tokens
        gen = torch.Generator().manual_seed(bias_seed)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_total_and_active_sizes(flavor):
    args = DEEPSEEK.flavors[flavor]
    total, active, within = PUBLISHED[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=within)
    assert args.num_params(active=True) / 1e9 == pytest.approx(active, abs=within)
    small = args.with_updates(n_layers=args.n_dense_layers + 1)
    assert sum(p.numel() for p in DEEPSEEK.build_meta(small).parameters()) == small.num_params()
    # MFU counts what a token computes: its routed experts, not all
    attention = 6 * args.n_layers * args.n_heads * (192 + 128) * 4096
    assert (
        args.flops_per_token(4096)
        == 6 * args.num_params(include_embedding=False, active=True) + attention
    )


def test_debug_model_has_every_part():
    model = built(DEBUG)
    kinds = [type(b.feed_forward).__name__ for b in model.layers.values()]
    assert kinds == ["FeedForward", "MoE", "MoE", "MoE"]  # n_dense_layers = 1
    moe = model.layers["1"].feed_forward
    assert moe.args.score_func == "sigmoid" and moe.args.n_groups == 4
    assert moe.shared_experts is not None and moe.router.expert_bias is not None
    assert hasattr(model.layers["0"].attention, "wq_a")  # the query bottleneck


def test_hf_config_round_trip_and_refusals():
    for name, args in DEEPSEEK.flavors.items():
        config = DEEPSEEK.state_dict_adapter(args).hf_config()
        assert (
            config["model_type"] == "deepseek_v3" and family_of_hf_config(config) == "deepseek_v3"
        )
        back = deepseek_v3_args_from_hf_config(config, args.max_seq_len)
        assert DEEPSEEK.matching_flavor(back) == name, (name, back)
    config = DEEPSEEK.state_dict_adapter(DEBUG).hf_config()
    for bad, message in [
        ({"num_experts_per_tok": 9}, r"top_k 9 must be between 1 and n_experts 8"),
        ({"n_group": 3}, r"n_groups 3 must divide n_experts 8 \(n_routed_experts"),
        (
            {"topk_group": 1, "num_experts_per_tok": 3},
            r"top_k 3 exceeds the 2 experts of "
            r"topk_groups groups",
        ),
        ({"scoring_func": "softmax"}, r"scoring_func='softmax'"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads != num_attention_heads"),
        ({"qk_rope_head_dim": 15}, r"qk_rope_head_dim 15 must be even"),
    ]:
        with pytest.raises(ValueError, match=message):
            deepseek_v3_args_from_hf_config({**config, **bad})


@pytest.mark.needs("transformers")
@pytest.mark.parametrize("variant", ["debugmodel", "no_q_lora_yarn", "halves_rope"])
def test_logits_and_both_hf_directions_match_transformers(variant, tmp_path):
    """With a non-zero correction bias: it changes the routing, not the weights."""
    import transformers

    args = {
        "debugmodel": DEBUG,
        # 671B's YaRN (mscale and mscale_all_dim) on a short original context
        "no_q_lora_yarn": DEBUG.with_updates(
            q_lora_rank=0,
            rope_scaling_factor=4.0,
            rope_original_max_len=16,
            rope_mscale=1.0,
            rope_mscale_all_dim=0.707,
        ),
        "halves_rope": DEBUG.with_updates(interleaved_rope=False),
    }[variant]
    model = built(args, seed=3, bias_seed=5)
    out = hf_io.save_hf(model.state_dict(), DEEPSEEK, args, tmp_path / "hf")
    names = hf_io.load_hf_state(out)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert names["model.layers.2.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    x = torch.randint(
        0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, rtol=0, atol=1e-4)
    if variant != "debugmodel":
        return
    # and back, from what transformers writes (sharded, one tensor per expert)
    hf_model.save_pretrained(str(tmp_path / "from_hf"), max_shard_size="1MB")
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in hf_io.load_hf_state(
        tmp_path / "from_hf"
    )
    assert (
        DEEPSEEK.matching_flavor(
            hf_io.args_from_hf(tmp_path / "from_hf", DEEPSEEK, args.max_seq_len)
        )
        == "debugmodel"
    )
    back = hf_io.load_hf(tmp_path / "from_hf", DEEPSEEK)
    state = model.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_values_go_to_sdpa_unpadded_where_it_takes_them(monkeypatch):
    """Where SDPA takes values narrower than queries (CUDA) they go unpadded: the logits and
    the gradients equal those of the padded values (the CPU's path) to float32 rounding."""
    from unittest import mock

    from titan.models.deepseek_v3 import mla

    tokens = torch.randint(0, DEBUG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    for unpadded in (False, True):
        monkeypatch.setattr(mla, "narrow_values_fit", lambda q, u=unpadded: u)
        model = built(DEBUG).train()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with mock.patch.object(mla.F, "scaled_dot_product_attention", wraps=sdpa) as spy:
            logits = model(tokens)
        widths = {c.args[2].shape[-1] for c in spy.call_args_list}
        assert widths == {DEBUG.v_head_dim if unpadded else DEBUG.head_dim}, widths
        logits.float().square().mean().backward()
        results[unpadded] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (padded_logits, padded_grads), (logits, grads) = results[False], results[True]
    torch.testing.assert_close(logits, padded_logits, rtol=0, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, padded_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_generation_with_the_cache_equals_the_full_forward():
    """Keys (nope + rope wide) and values (v_head_dim wide) cached per layer: token by token
    gives the logits of one pass over the whole sequence, YaRN included."""
    from titan.models.common.decode import DecodeCache

    args = DEBUG.with_updates(
        rope_scaling_factor=4.0, rope_original_max_len=16, rope_mscale=1.0, rope_mscale_all_dim=1.0
    )
    model = built(args, bias_seed=1)
    x = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(x)
        cache = DecodeCache(max_len=16, pad=torch.zeros(2, dtype=torch.long))
        steps = [model(x[:, :5], cache=cache)] + [
            model(x[:, i : i + 1], cache=cache) for i in range(5, 12)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


one_rank = one_rank_run(*RUN.argv, steps=STEPS)


LAYOUTS = {
    # tp2:
    # MLA's heads split, its latents whole on every rank, the shared key's gradient summed;
    # routed experts on each rank's half of the sequence, the shared experts split (without
    # sequence parallelism too: tests/unit/test_qwen3_moe.py runs that path for the MoE, and
    # MLA's plan does not depend on it)
    # cp2:
    # ring attention over values padded to the query/key width
    **layouts("fsdp2", "hsdp2x2", "tp2", "pp2", "cp2", "fsdp2_tp2"),
}


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """The 1-rank run from a start whose routing sends every token to the first half of the
    experts (rank 0's under ep 2): correction biases of 2 on them beside sigmoid scores in
    (0, 1). At the rate of 0.01 a step the biases stay more than 1 ahead for the 10 steps, so
    one ep rank receives every row and the other none, in every MoE layer."""
    from titan.components.checkpoint import folders

    tmp = tmp_path_factory.mktemp("skewed")
    run_trainer(
        tmp / "seed",
        1,
        [*COMMON, *BIAS, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"],
    )
    seed = tmp / "seed" / "dump" / "checkpoint" / "step-0"
    state = folders.load_dcp_model_state(seed)
    for name, t in state.items():
        if name.endswith("expert_bias"):
            t[: t.numel() // 2] = 2.0
    start = folders.save_dcp_model_state(state, tmp / "start", model=folders.saved_model(seed))
    argv = [*COMMON, *BIAS, *CKPT, "--checkpoint.initial_load_path", str(start)]
    records = run_trainer(tmp, 1, argv)
    # half of the experts get every token: the largest load is at least twice the mean
    assert all(r["expert_load_imbalance"] >= 2.0 for r in records)
    return records, tmp / "dump" / "checkpoint", argv


# expert parallelism: routed experts split over ep ranks, tokens sent by all-to-all, from the
# skewed start (one ep rank computes every row; the other sends all and receives none)
EP_LAYOUTS = {
    "ep2": (2, degrees(expert_parallel=2)),
    # ep from the context-parallel ranks
    "ep2_cp2": (2, degrees(expert_parallel=2, context_parallel=2)),
    # each expert also FSDP-sharded over the 2 ranks holding it (efsdp 2), replicated on the
    # tp ranks, each tp rank dispatching its half of the sequence
    "ep2_fsdp4_tp2": (
        8,
        [*degrees(expert_parallel=2, tensor_parallel=2), "--training.local_batch_size", "2"],
    ),
    # without sequence parallelism, both tp ranks dispatch the same tokens
    "ep2_tp2_no_sp": (
        4,
        [
            *degrees(expert_parallel=2, tensor_parallel=2),
            "--parallelism.no_enable_sequence_parallel",
        ],
    ),
    "ep2_pp2": (4, degrees(expert_parallel=2, pipeline_parallel=2)),
    "ep2_hsdp2x2": (
        4,
        [
            *degrees(expert_parallel=2, data_parallel_replicate=2),
            "--training.local_batch_size",
            "2",
        ],
    ),
}


@pytest.mark.slow("expert-parallel layouts of up to 8 ranks")
@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_expert_parallel_layouts_train_like_one_process_when_skewed(layout, skewed, tmp_path):
    world, flags = EP_LAYOUTS[layout]
    check_layout_like_one_process(
        skewed[:2], tmp_path, world, [*skewed[2], *flags], STEPS, moe_layers=3, layout=layout
    )
    if layout == "ep2":
        # rank 0 received every row of both ranks: the planner's bound for imbalanced routing
        # is what it held (the balanced plan is below it), and rank 1, which received none,
        # held less than the balanced plan
        from tests.unit.test_memory_plan import planned_bytes

        plan = planned_bytes([*skewed[2], *flags], world, tmp_path)
        measured = json.loads((tmp_path / "dump" / "memory_measured.json").read_text())["ranks"]
        held = [m["activations_bytes"] for m in measured]
        assert abs(plan[0]["worst_routing_activations_bytes"] / held[0] - 1) <= 0.02, (plan, held)
        assert held[1] < plan[1]["activations_bytes"] < held[0]


@pytest.mark.slow("two torchrun agents, as two nodes")
def test_expert_parallel_across_two_torchrun_agents(skewed, tmp_path):
    """ep 4 on 2 simulated nodes x 2 ranks (run_train.sh, one torchrun agent a node, c10d
    rendezvous): the all-to-alls cross the agents, and the skewed routing sends every row to
    the two ranks of node 0."""
    from tests.integration.harness import Nodes, read_metrics

    flags = ["--parallelism.expert_parallel_degree", "4", "--training.local_batch_size", "2"]
    dump, defaults = tmp_path / "dump", tmp_path / "defaults.toml"
    defaults.write_text("")  # the config defaults, as the forked 1-rank run had them
    with Nodes(
        2, 2, [*skewed[2], *flags], dump, tmp_path, env={"CONFIG_FILE": str(defaults)}
    ) as nodes:
        outs = nodes.wait(timeout=300)
    assert all(code == 0 for code, _, _ in outs), nodes.rank_tails()
    check_run_like_one_process(
        skewed[:2], read_metrics(dump), dump, STEPS, moe_layers=3, layout="ep4 on 2 nodes"
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_and_balance_like_one_process(layout, one_rank, tmp_path):
    """As for Qwen3-MoE (tests/unit/test_qwen3_moe.py): routing is discrete, so a layout
    agrees with one process while no token's k-th and (k+1)-th choices are closer than the
    layouts' rounding differences (~1e-8 in the scores). Over these 10 steps (the balance loss
    and the bias update on) the closest experts are 4.6e-6 apart and the closest groups 8.3e-6."""
    RUN.check_layout(one_rank, tmp_path, layout, *LAYOUTS[layout])


def test_resume_is_bitwise_with_the_bias(one_rank, tmp_path):
    RUN.check_resume(one_rank, tmp_path)


def test_other_balancing_settings_load_the_checkpoint(one_rank, tmp_path, caplog):
    """The balancing rate and coefficient are training settings, not the architecture: a
    checkpoint trained at rate 0.01 generates with the flavor's defaults (0.001) and starts a
    run at other settings, which the load logs; the architecture is still compared."""
    import logging

    from titan.components.checkpoint.identity import model_identity
    from titan.config import parse_args
    from titan.tools.generate import model_args

    step = one_rank[1] / f"step-{STEPS}"
    args = model_args(step, parse_args([]), DEEPSEEK)  # no config: the flavor's settings
    assert args.moe_bias_update_rate == 0.001 and args.moe_aux_loss_coeff == 0.0001
    other = args.with_updates(moe_bias_update_rate=0.002, moe_aux_loss_scope="global_batch")
    with caplog.at_level(logging.INFO, logger="titan.components.checkpoint.identity"):
        assert model_identity(DEEPSEEK, "debugmodel", other).problem(step) is None
    assert "moe_bias_update_rate 0.01 -> 0.002" in caplog.text
    assert "moe_aux_loss_scope sequence -> global_batch" in caplog.text
    rope = model_identity(DEEPSEEK, "debugmodel", args.with_updates(rope_theta=5000.0))
    assert "rope_theta 10000.0 (checkpoint) vs 5000.0 (this run)" in rope.problem(step)
    records = run_trainer(
        tmp_path,
        1,
        [
            *COMMON,
            "--deepseek_v3.moe_bias_update_rate",
            "0.002",
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            str(step),
            "--training.steps",
            "2",
        ],
    )
    assert [r["step"] for r in records] == [1, 2]
    # trained weights: far below the first loss of a fresh start
    assert records[0]["loss"] < one_rank[0][0]["loss"] - 0.5


def test_sequence_balance_loss_is_logged_apart_and_trained(one_rank, tmp_path):
    """The flavor's sequence-wise loss at 0.0001. `loss` stays the cross-entropy (step 1
    equals the run without the loss); the loss reaches the gradients (at 0.0001 below
    float32's resolution of the grad norm, so shown at 0.1)."""
    first = one_rank[0][0]
    # balanced, each of the 3 MoE layers' losses is 1; at init they are close to it
    assert first["moe_aux_loss"] == pytest.approx(3 * 0.0001, rel=0.1)
    one_step = [*COMMON, *BIAS, "--training.steps", "1"]
    off = run_trainer(tmp_path / "off", 1, [*one_step, "--deepseek_v3.moe_aux_loss_coeff", "0"])
    assert off[0]["loss"] == first["loss"] and "moe_aux_loss" not in off[0]
    strong = run_trainer(
        tmp_path / "strong", 1, [*one_step, "--deepseek_v3.moe_aux_loss_coeff", "0.1"]
    )
    assert strong[0]["loss"] == first["loss"]
    assert strong[0]["moe_aux_loss"] == pytest.approx(1000 * first["moe_aux_loss"], rel=1e-5)
    assert strong[0]["grad_norm"] != off[0]["grad_norm"]


@pytest.mark.needs("transformers")
def test_a_save_pretrained_folder_starts_training_at_transformers_loss(tmp_path):
    def nonzero_bias(hf_model):
        gen = torch.Generator().manual_seed(4)
        for name, b in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.1)

    check_save_pretrained_start(
        tmp_path,
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        DEBUG,
        family="deepseek_v3",
        prepare=nonzero_bias,
    )


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "pp2", "ep2_fsdp4_tp2"])
def test_hf_export_and_load_from_sharded_layouts(layout, tmp_path):
    """Each rank writes and reads the experts it holds, one tensor per expert, and the
    correction bias; the folder and the reloaded model equal the one-process model. Under
    ep 2 x efsdp 2 each rank holds a quarter of the experts (FSDP's strided shard of its ep
    rank's half)."""
    world, flags = {**LAYOUTS, **EP_LAYOUTS}[layout]
    expected = built(DEBUG.with_updates(max_seq_len=32)).state_dict()
    check_hf_round_trip(tmp_path, world, [*COMMON, *flags], DEEPSEEK, expected)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--deepseek_v3.moe_bias_update_rate", "-1"],
            r"debugmodel, deepseek_v3\.moe_bias_update_rate = -1\.0 \(from command line "
            r"'--deepseek_v3\.moe_bias_update_rate -1'\): moe: bias_update_rate -1\.0 must be >= 0",
        ),
        (
            ["--compile.enable", "--parallelism.tensor_parallel_degree", "2"],
            r"compile\.enable = True .*under tensor parallelism runs eagerly",
        ),
    ],
)
def test_what_it_cannot_do_is_refused_before_launch(flags, message, tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args([*COMMON, *flags, "--job.dump_folder", str(tmp_path)])
    with pytest.raises(ConfigError, match=message):
        plan_run(job, 2)


def test_an_hf_folder_of_another_shape_is_named_before_launch(tmp_path):
    """Experts, groups and MLA ranks of the folder against the flavor, field by field."""
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    other = DEBUG.with_updates(
        kv_lora_rank=32,
        moe=DEBUG.moe.__class__(**{**DEBUG.moe.__dict__, "n_experts": 16, "n_groups": 8}),
    )
    hf_io.save_hf(built(other).state_dict(), DEEPSEEK, other, tmp_path / "hf")
    job = parse_args(
        [
            *COMMON,
            "--checkpoint.initial_load_path",
            str(tmp_path / "hf"),
            "--checkpoint.initial_load_in_hf",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"another architecture than model.flavor = "
        r"'debugmodel': kv_lora_rank 32 vs 64; "
        r"moe.n_experts 16 vs 8; moe.n_groups 8 vs 4;",
    ):
        plan_run(job, 1)


@pytest.mark.needs("transformers")
def test_convert_to_hf_writes_what_transformers_loads(one_rank, tmp_path):
    """A trained checkpoint (its routing biases moved) through scripts/convert_to_hf.py: the
    folder transformers loads gives titan's logits."""
    import transformers

    from tests.unit.test_qwen3 import _script
    from titan.components.checkpoint import folders as checkpoint

    step = one_rank[1] / f"step-{STEPS}"
    _script("convert_to_hf").main([str(step), str(tmp_path / "hf"), "--max-seq-len", "32"])
    model = built(DEBUG.with_updates(max_seq_len=32))
    model.load_state_dict(checkpoint.load_dcp_model_state(step))
    assert model.layers["1"].feed_forward.router.expert_bias.abs().sum() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    x = torch.randint(0, DEBUG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, rtol=0, atol=1e-4)
