"""Qwen3-MoE, the qwen3 family's mixture-of-experts flavors: published total and active sizes;
logits and both HF directions (per-expert tensors) against transformers' Qwen3MoeForCausalLM;
every layout trains like one process with the routing bias moving, and moves it alike; resume
is bitwise, bias included; the load-balancing loss and the load metrics."""

import sys
import warnings

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import degrees, layouts, one_rank_run
from tests.moe_checks import (
    BalancedRun,
    check_hf_round_trip,
)
from tests.unit.test_qwen3 import check_save_pretrained_start
from titan.components.checkpoint import hf_io
from titan.models.qwen3.state_dict_adapter import qwen3_args_from_hf_config
from titan.models.spec import family_of_hf_config, get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

QWEN3 = get_train_spec("qwen3")
DEBUG = QWEN3.flavors["debugmodel_moe"].with_updates(max_seq_len=64)
STEPS = 10
# the flavor's load-balancing loss (0.001, per sequence) and the bias update on (a large rate,
# so that a few steps move the routing): what every layout must reproduce exactly
BIAS = ["--qwen3.moe_bias_update_rate", "0.01"]
COMMON = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", *tiny_run(STEPS)]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
RUN = BalancedRun([*COMMON, *BIAS, *CKPT], STEPS)

# (total, active) parameters in billions as the Qwen3-MoE model cards give them, and how close
# titan's count must be: the cards round to 0.1B and to 1B (titan: 30.53 / 3.35 and
# 235.09 / 22.19, the output matrix counted as active, the embedding too)
PUBLISHED = {"30B-A3B": (30.5, 3.3, 0.1), "235B-A22B": (235.0, 22.0, 0.5)}


def built(args, seed=0):
    return built_model(QWEN3, args, seed)


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_total_and_active_sizes(flavor):
    args = QWEN3.flavors[flavor]
    total, active, within = PUBLISHED[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=within)
    assert args.num_params(active=True) / 1e9 == pytest.approx(active, abs=within)
    small = args.with_updates(n_layers=2)
    assert sum(p.numel() for p in QWEN3.build_meta(small).parameters()) == small.num_params()
    # MFU counts what a token computes: its 8 experts, not 128
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert (
        args.flops_per_token(4096)
        == 6 * args.num_params(include_embedding=False, active=True) + attention
    )


def test_debug_model_has_dense_and_moe_blocks():
    model = built(DEBUG)
    kinds = [type(b.feed_forward).__name__ for b in model.layers.values()]
    assert kinds == ["FeedForward", "MoE", "MoE", "MoE"]  # mlp_only_layers = (0,)
    assert model.layers["1"].feed_forward.experts.w1.shape == (8, 128, 256)
    assert DEBUG.num_params(active=True) < DEBUG.num_params()


def test_hf_config_round_trip_and_refusals():
    for name in ("debugmodel_moe", "30B-A3B", "235B-A22B"):
        args = QWEN3.flavors[name]
        config = QWEN3.state_dict_adapter(args).hf_config()
        assert config["model_type"] == "qwen3_moe" and family_of_hf_config(config) == "qwen3"
        assert QWEN3.matching_flavor(qwen3_args_from_hf_config(config, args.max_seq_len)) == name
    config = QWEN3.state_dict_adapter(DEBUG).hf_config()
    with pytest.raises(
        ValueError,
        match=r"top_k 9 must be between 1 and n_experts 8 "
        r"\(num_experts / num_experts_per_tok\)",
    ):
        qwen3_args_from_hf_config({**config, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match=r"mlp_only_layers \[7\] are not layers of a 4-layer"):
        qwen3_args_from_hf_config({**config, "mlp_only_layers": [7]})
    # transformers 5 writes the expert count as num_local_experts
    renamed = {k: v for k, v in config.items() if k != "num_experts"}
    assert qwen3_args_from_hf_config(
        {**renamed, "num_local_experts": 8}
    ) == qwen3_args_from_hf_config(config)


def test_a_routing_bias_is_not_exported_to_a_layout_without_one():
    args = DEBUG.with_updates(moe_bias_update_rate=0.01)
    adapter = QWEN3.state_dict_adapter(args)
    assert adapter.export_problems(args) and not adapter.export_problems(DEBUG)
    with pytest.raises(ValueError, match="no routing bias"):
        adapter.to_hf(built(args).state_dict())


@pytest.mark.needs("transformers")
def test_logits_and_both_hf_directions_match_transformers(tmp_path):
    import transformers

    model = built(DEBUG, seed=3)
    out = hf_io.save_hf(model.state_dict(), QWEN3, DEBUG, tmp_path / "hf")
    names = hf_io.load_hf_state(out)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert (
        "model.layers.1.mlp.gate.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    x = torch.randint(
        0, DEBUG.vocab_size, (2, DEBUG.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, rtol=0, atol=1e-4)
    # and back, from what transformers writes (sharded, one tensor per expert)
    hf_model.save_pretrained(str(tmp_path / "from_hf"), max_shard_size="1MB")
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in hf_io.load_hf_state(
        tmp_path / "from_hf"
    )
    assert hf_io.args_from_hf(tmp_path / "from_hf", QWEN3, DEBUG.max_seq_len) == DEBUG
    back = hf_io.load_hf(tmp_path / "from_hf", QWEN3)
    state = model.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


one_rank = one_rank_run(*RUN.argv, steps=STEPS)


LAYOUTS = {
    # tp2:
    # router and routed experts on each rank's half of every sequence, gradients summed
    # tp2_no_sp:
    # ... and without sequence parallelism, every rank on every token
    # compile:
    # blocks compiled around the host-side split sizes (fullgraph off)
    # ep2:
    # experts split over 2 ranks, tokens dispatched by all-to-all (softmax routing)
    **layouts("fsdp2", "hsdp2x2", "tp2", "tp2_no_sp", "pp2", "cp2", "fsdp2_tp2", "compile", "ep2"),
    # the routing and grouped GEMM saved, the rest recomputed (counted twice: same ratios)
    "fsdp2_selective_ac": (
        2,
        [*degrees(data_parallel_shard=2), "--activation_checkpoint.mode", "selective"],
    ),
}


@pytest.mark.slow("MoE layouts of up to 4 ranks, one compiled")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_and_balance_like_one_process(layout, one_rank, tmp_path):
    """Routing is discrete: a layout agrees with one process exactly when no token's k-th and
    (k+1)-th expert scores are closer than the layouts' rounding differences. Over these 10
    steps (the balancing loss and the bias update on) the closest pair is 3.2e-6 apart; layouts
    differ by ~1e-8 in the scores (losses by 1.2e-7 relative, under 1 and 2 threads), and
    another CPU moves the gaps by as little."""
    RUN.check_layout(one_rank, tmp_path, layout, *LAYOUTS[layout])


def test_resume_is_bitwise_with_the_bias(one_rank, tmp_path):
    RUN.check_resume(one_rank, tmp_path)


def test_load_balancing_loss_is_logged_apart_and_trained(one_rank, tmp_path):
    """The flavor's own balancing loss at 0.001. `loss` stays the cross-entropy (step 1 equals
    the run without it); the aux loss changes the gradients."""
    first = one_rank[0][0]
    # balanced, each of 3 MoE layers' losses is top_k = 2; at init they are close to it
    assert first["moe_aux_loss"] == pytest.approx(3 * 0.001 * 2, rel=0.05)
    off = run_trainer(
        tmp_path, 1, [*COMMON, *BIAS, "--training.steps", "1", "--qwen3.moe_aux_loss_coeff", "0"]
    )
    assert off[0]["loss"] == first["loss"] and "moe_aux_loss" not in off[0]
    assert off[0]["grad_norm"] != first["grad_norm"]


# the loss over the whole global batch: one forward per rank (local batch = global / dp)
GLOBAL = [*COMMON, "--qwen3.moe_aux_loss_scope", "global_batch", "--training.steps", "5"]
GLOBAL_LAYOUTS = {
    "fsdp2": (2, degrees(data_parallel_shard=2)),
    "cp2": (2, degrees(context_parallel=2)),
    "fsdp2_tp2_ep2": (4, degrees(data_parallel_shard=2, tensor_parallel=2, expert_parallel=2)),
}


@pytest.fixture(scope="module")
def one_forward(tmp_path_factory):
    return run_trainer(
        tmp_path_factory.mktemp("global"), 1, [*GLOBAL, "--training.local_batch_size", "8"]
    )


@pytest.mark.parametrize("layout", list(GLOBAL_LAYOUTS))
def test_the_global_batch_scope_is_one_loss_on_every_layout(layout, one_forward, tmp_path):
    """Every expert's count over all ranks' tokens, summed in forward: the loss of the whole
    batch (with its gradient) equals one process's, for data-, context-, tensor- and
    expert-parallel ranks."""
    world, flags = GLOBAL_LAYOUTS[layout]
    dp = 2 if "fsdp2" in layout else 1
    got = run_trainer(
        tmp_path, world, [*GLOBAL, *flags, "--training.local_batch_size", str(8 // dp)]
    )
    assert one_forward[0]["moe_aux_loss"] == pytest.approx(3 * 0.001 * 2, rel=0.05)
    for a, b in zip(one_forward, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a, b)
        assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-5 * a["moe_aux_loss"], (a, b)


@pytest.mark.needs("transformers")
def test_a_save_pretrained_folder_starts_training_at_transformers_loss(tmp_path):
    check_save_pretrained_start(tmp_path, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", DEBUG)


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp2_tp2", "pp2"])
def test_hf_export_and_load_from_sharded_layouts(layout, tmp_path):
    """Each rank writes and reads the experts it holds (FSDP: 4 of the 8 of every layer),
    one tensor per expert; the folder and the reloaded model equal the one-process model."""
    world, flags = LAYOUTS[layout]
    expected = built(DEBUG.with_updates(max_seq_len=32)).state_dict()
    ranks = check_hf_round_trip(tmp_path, world, [*COMMON, *flags], QWEN3, expected)
    if layout == "fsdp2":  # half the experts each, and half of everything else
        experts = sum(v.numel() * 4 for k, v in expected.items() if ".experts." in k)
        total = sum(v.numel() * 4 for v in expected.values())
        assert sum(n for n, _ in ranks) == total
        assert all(n <= total / 2 + experts * 0.01 for n, _ in ranks), [n for n, _ in ranks]


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--qwen3.moe_bias_update_rate", "-1"],
            r"debugmodel_moe, qwen3\.moe_bias_update_rate = -1\.0 \(from command line "
            r"'--qwen3\.moe_bias_update_rate -1'\): moe: bias_update_rate -1\.0 must be >= 0",
        ),
        (
            [
                "--qwen3.moe_bias_update_rate",
                "0.001",
                "--checkpoint.enable",
                "--checkpoint.last_save_in_hf",
            ],
            r"checkpoint\.last_save_in_hf = True .*no routing bias",
        ),
        (
            ["--compile.enable", "--parallelism.tensor_parallel_degree", "2"],
            r"compile\.enable = True .*under tensor parallelism runs eagerly",
        ),
        (
            ["--qwen3.moe_aux_loss_scope", "global_batch", "--training.local_batch_size", "2"],
            r"qwen3\.moe_aux_loss_scope = 'global_batch' .*: one loss term over the whole "
            r"global batch needs each rank's step in one forward, but gradient accumulation "
            r"splits it into 2 .*set "
            r"training\.local_batch_size = global_batch_size / dp, or qwen3\.moe_aux_loss_scope = "
            r"'sequence'",
        ),
        (
            [
                "--qwen3.moe_aux_loss_scope",
                "global_batch",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "8",
            ],
            r"pipeline parallelism splits it into microbatches: use qwen3\.moe_aux_loss_scope = "
            r"'sequence' with pipeline parallelism",
        ),
        (
            ["--qwen3.moe_aux_loss_scope", "per_token"],
            r"qwen3\.moe_aux_loss_scope = 'per_token' .*choose one of sequence, global_batch",
        ),
    ],
)
def test_what_an_moe_cannot_do_is_refused_before_launch(flags, message, tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    with pytest.raises(ConfigError, match=message):
        plan_run(parse_args([*COMMON, *flags, "--job.dump_folder", str(tmp_path)]), 2)


def test_a_skipped_step_moves_no_bias():
    """The routing counts of a step whose update is skipped (a non-finite loss) are dropped:
    the next step's bias update sees only its own counts."""
    from titan.config import parse_args
    from titan.models.common.aux_loss import AuxLossCollector
    from titan.models.common.moe_balance import moe_balance_hook

    args = DEBUG.with_updates(max_seq_len=32, moe_bias_update_rate=0.01)
    model = built(args).train()
    hook = moe_balance_hook([model], parse_args([]))
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def forward():
        with AuxLossCollector(1.0):
            model(tokens)

    def state():
        return {k: v.clone() for k, v in model.state_dict().items() if "expert_bias" in k}

    forward()
    before = state()
    assert hook(False) == {}  # skipped: nothing moves, the counts are gone
    assert all(torch.equal(before[k], v) for k, v in state().items())
    assert all(m.expert_load.sum() == 0 for m in model.modules() if hasattr(m, "expert_load"))
    forward()
    metrics = hook(True)
    fresh = built(args).train()
    fresh_hook = moe_balance_hook([fresh], parse_args([]))
    with AuxLossCollector(1.0):
        fresh(tokens)
    # one step's counts, as if the skipped step had never run
    assert metrics["expert_load_imbalance"] == fresh_hook(True)["expert_load_imbalance"]
    assert all(
        torch.equal(v, w)
        for v, w in zip(
            state().values(), (v for k, v in fresh.state_dict().items() if "expert_bias" in k)
        )
    )
