"""Qwen3.5's text model (model.name = qwen3_5, dense and MoE): released sizes; logits, both HF
directions and greedy generation against transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM; the released vision-language checkpoints read with their vision tower
(the MTP layer left; tests/unit/test_vision_language.py checks the tower); such a folder loads
alike on FSDP, TP and EP (the projections
whose rows Qwen3.5 orders otherwise than titan gathered and resharded) and trains like one
process; a folder transformers wrote starts training at its step-1 loss. The model itself is
Qwen3-Next's (tests/unit/test_qwen3_next.py: documents, decoding, every layout, resume)."""

import json
import sys

import pytest
import torch

from tests.forked import run_trainer, tiny_run
from tests.unit import test_qwen3_next
from tests.unit.test_qwen3 import check_save_pretrained_start
from tests.unit.test_qwen3_next import tokens
from titan.components.checkpoint import hf_io
from titan.models.spec import get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

SPEC = get_train_spec("qwen3_5")
DENSE = SPEC.flavors["debugmodel"].with_updates(max_seq_len=64)
MOE = SPEC.flavors["debugmodel_moe"].with_updates(max_seq_len=64)
FLAVORS = {"dense": DENSE, "moe": MOE}
STEPS = 4


def built(args, seed=0):
    return test_qwen3_next.built(args, seed, spec=SPEC)


@pytest.mark.parametrize(
    "flavor, total, active",
    [("27B", 27, 27), ("35B-A3B", 35, 3), ("122B-A10B", 122, 10), ("397B-A17B", 397, 17)],
)
def test_released_sizes(flavor, total, active):
    """The model cards' totals (which count the vision tower too, under 1B) within 1B; the
    parameters a token uses (with the embedding) within 0.5B."""
    args = SPEC.flavors[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=1)
    assert args.num_params(active=True) / 1e9 == pytest.approx(active, abs=0.5)
    assert [args.is_linear_layer(i) for i in range(8)] == [True, True, True, False] * 2
    assert all(args.is_moe_layer(i) for i in range(args.n_layers)) == (args.moe is not None)


def test_debug_models_hold_the_counted_parameters():
    for args in FLAVORS.values():
        assert sum(p.numel() for p in built(args).parameters()) == args.num_params()


@pytest.mark.needs("transformers")
@pytest.mark.parametrize("kind", list(FLAVORS))
def test_logits_both_hf_directions_and_generation_match_transformers(tmp_path, kind):
    args = FLAVORS[kind]
    model = built(args, seed=3)
    out = hf_io.save_hf(model.state_dict(), SPEC, args, tmp_path / "hf")
    names = hf_io.load_hf_state(out)
    for part in ("qkv", "z", "b", "a"):
        assert f"model.layers.0.linear_attn.in_proj_{part}.weight" in names
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" not in names
    if kind == "moe":  # the hub's one tensor of gate-and-up rows for all experts
        assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 256, 256)
        assert "model.layers.3.mlp.shared_expert_gate.weight" in names
    hf_class = "Qwen3_5MoeForCausalLM" if kind == "moe" else "Qwen3_5ForCausalLM"
    test_qwen3_next.check_against_transformers(tmp_path, model, args, SPEC, out, hf_class)


def vision_language_folder(folder, args) -> None:
    """What Qwen publishes: transformers' Qwen3.5 vision-language model (a one-block vision
    tower), saved, plus an MTP tensor as the released files hold one."""
    import transformers
    from safetensors.torch import load_file, save_file

    moe = args.moe is not None
    text = SPEC.state_dict_adapter(args).hf_config()
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    config = getattr(transformers, "Qwen3_5MoeConfig" if moe else "Qwen3_5Config")(
        text_config=text,
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": args.dim,
            "patch_size": 4,
            "num_position_embeddings": 16,
        },
    )
    torch.manual_seed(0)
    cls = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    hf_model = getattr(transformers, cls)(config).eval()
    hf_model.save_pretrained(str(folder))
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["mtp.fc.weight"] = torch.zeros(args.dim, 2 * args.dim)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return hf_model


@pytest.mark.needs("transformers")
@pytest.mark.parametrize("kind", list(FLAVORS))
def test_a_vision_language_checkpoint_gives_its_model_with_the_tower(tmp_path, kind):
    from titan.models.common.vision_args import VisionArgs

    args = FLAVORS[kind]
    hf_model = vision_language_folder(tmp_path / "vl", args)
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert config["model_type"] == ("qwen3_5_moe" if kind == "moe" else "qwen3_5")
    names = hf_io.load_hf_state(tmp_path / "vl")
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    tower = VisionArgs(
        depth=1, dim=32, ffn_dim=64, n_heads=2, patch_size=4, num_position_embeddings=16
    )
    args = args.with_updates(vision=tower.with_updates(out_dim=args.dim))
    assert hf_io.args_from_hf(tmp_path / "vl", SPEC, args.max_seq_len) == args
    model = built(args)  # the tower's weights read too (the MTP layer's left)
    model.load_state_dict(hf_io.load_hf(tmp_path / "vl", SPEC))
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(input_ids=x).logits, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def vl_moe_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("vl_moe") / "hf"
    vision_language_folder(folder, MOE.with_updates(max_seq_len=32))
    return folder


def from_folder(folder) -> list[str]:
    """Start from the HF `folder`, end with an HF export (every rank writing its shards)."""
    return [
        "--model.name",
        "qwen3_5",
        "--model.flavor",
        "from_hf",
        *tiny_run(STEPS),
        "--checkpoint.initial_load_path",
        str(folder),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",
        "--checkpoint.last_save_in_hf",
    ]


def exported(tmp) -> dict[str, torch.Tensor]:
    return hf_io.load_hf_state(tmp / "dump" / "checkpoint" / f"step-{STEPS}")


@pytest.fixture(scope="module")
def one_rank_from_folder(vl_moe_folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    return run_trainer(tmp, 1, from_folder(vl_moe_folder)), exported(tmp)


# each loads the released layout's projections and experts into its own sharding
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "ep2": [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
    ],
}


@pytest.mark.needs("transformers")
@pytest.mark.slow("a 2-rank training from an HF folder")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_released_layout_folder_trains_alike_on_every_layout(
    vl_moe_folder, one_rank_from_folder, tmp_path, layout
):
    two = run_trainer(tmp_path, 2, [*from_folder(vl_moe_folder), *LAYOUTS[layout]])
    one, one_export = one_rank_from_folder
    assert len(one) == len(two) == STEPS
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)
    # the export, written from this layout's shards in the hub's row order, is one rank's:
    # Adam's normalized steps carry the layouts' float32 gradient differences into the
    # weights at ~1e-5 after 4 steps; a row out of place would differ at the weights' 0.1
    two_export = exported(tmp_path)
    assert set(two_export) == set(one_export)
    # the released layout: the text model under model.language_model, the tower beside it
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in two_export
    assert "model.visual.patch_embed.proj.weight" in two_export
    for name, t in one_export.items():
        torch.testing.assert_close(two_export[name], t, rtol=0, atol=1e-4, msg=name)


@pytest.mark.needs("transformers")
def test_a_save_pretrained_folder_starts_training_at_transformers_loss(tmp_path):
    check_save_pretrained_start(
        tmp_path, "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE, family="qwen3_5"
    )


def test_configs_titan_cannot_express_are_refused():
    from titan.models.qwen3_5.state_dict_adapter import (
        Qwen3_5StateDictAdapter,
        qwen3_5_args_from_hf_config,
    )

    config = SPEC.state_dict_adapter(MOE).hf_config()
    with pytest.raises(ValueError, match=r"model_type='qwen3_next' is not a Qwen3.5 model"):
        qwen3_5_args_from_hf_config({**config, "model_type": "qwen3_next"})
    layers = ["full_attention"] * MOE.n_layers
    with pytest.raises(ValueError, match=r"titan's Qwen3.5: layer_types other than"):
        qwen3_5_args_from_hf_config({"text_config": {**config, "layer_types": layers}})
    assert Qwen3_5StateDictAdapter.export_problems(MOE.with_updates(mlp_only_layers=(0,))) == [
        "Qwen3.5-MoE in the hub layout routes every layer (no dense layers)"
    ]
