"""The bundled image-text debug config (train_configs/debug_vlm.toml: Qwen3-VL's debug model,
its tower trained with the decoder on the pictures of shapes) trains alike on every layout:
FSDP (the tower's blocks sharded with the decoder's), TP with and without sequence
parallelism (the tower whole on each rank), PP (the tower on the first stage), CP (each rank
places its part of the sequence's image tokens) and FSDP x TP; with activation checkpointing
of the tower's blocks too. Resume is bitwise and the loss falls. Qwen3.5's tower trains alike
under TP, FSDP, PP and CP as well, and Qwen3-VL's MoE flavor under EP."""

import sys

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import degrees, one_rank_run
from tests.moe_checks import check_resume_is_bitwise
from titan.models.spec import get_train_spec

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="needs fork"),
    pytest.mark.needs("PIL"),
]

STEPS = 6
RUN = [
    "--job.config_file",
    "train_configs/debug_vlm.toml",
    *tiny_run(STEPS),
    *["--training.seq_len", "128", "--training.local_batch_size", "2"],
    *["--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "3"],
]
one_rank = one_rank_run(*RUN, steps=STEPS)

LAYOUTS = {
    "fsdp2": (2, degrees(data_parallel_shard=2)),
    "tp2_sp": (2, degrees(tensor_parallel=2)),
    "tp2_no_sp": (2, [*degrees(tensor_parallel=2), "--parallelism.no_enable_sequence_parallel"]),
    "pp2": (2, degrees(pipeline_parallel=2)),
    "cp2": (2, degrees(context_parallel=2)),
    "fsdp2_tp2": (4, degrees(data_parallel_shard=2, tensor_parallel=2)),
    "fsdp2_full_ac": (2, [*degrees(data_parallel_shard=2), "--activation_checkpoint.mode", "full"]),
}


@pytest.mark.slow("the debug VLM on up to 4 forked ranks")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_like_one_process(one_rank, tmp_path, layout):
    world, flags = LAYOUTS[layout]
    records, _ = one_rank
    got = run_trainer(tmp_path, world, [*RUN, *flags, "--checkpoint.no_enable"], deadline_s=300)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in records], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx(
        [r["grad_norm"] for r in records], rel=1e-5
    )


def test_resume_is_bitwise_and_the_loss_falls(one_rank, tmp_path):
    records, _ = one_rank
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 1.0
    # tokens/s of text and of images apart: 3 to 6 pictures a window of 128, 16 to 24
    # places each
    for r in records:
        assert r["text_tps"] + r["image_tps"] == pytest.approx(r["tps"], rel=1e-9)
        assert 0.3 < r["image_tps"] / r["tps"] < 0.8
    check_resume_is_bitwise(one_rank, tmp_path, RUN, STEPS, at=3)


OTHERS = {
    # Qwen3.5's tower (no DeepStack) in front of the hybrid decoder
    "qwen3_5": ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_vision"],
    # Qwen3-VL's MoE flavor, its experts balanced
    "qwen3_vl_moe": ["--model.flavor", "debugmodel_moe"],
}
OTHER_LAYOUTS = {
    "qwen3_5": {
        "tp2": degrees(tensor_parallel=2),
        "fsdp2": degrees(data_parallel_shard=2),
        "pp2": degrees(pipeline_parallel=2),
        "cp2": degrees(context_parallel=2),
    },
    "qwen3_vl_moe": {"ep2": degrees(data_parallel_shard=2, expert_parallel=2)},
}


@pytest.fixture(scope="module")
def other_one_rank(tmp_path_factory):
    out = {}
    for name, flags in OTHERS.items():
        out[name] = run_trainer(tmp_path_factory.mktemp(name), 1, [*RUN[:-3], *flags])
    return out


@pytest.mark.slow("the other VL flavors on 2 forked ranks")
@pytest.mark.parametrize(
    "name, layout", [(n, lay) for n, layouts in OTHER_LAYOUTS.items() for lay in layouts]
)
def test_the_other_vl_flavors_train_alike(other_one_rank, tmp_path, name, layout):
    flags = [*RUN[:-3], *OTHERS[name], *OTHER_LAYOUTS[name][layout]]
    got = run_trainer(tmp_path, 2, flags, deadline_s=300)
    one = other_one_rank[name]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in one], rel=1e-5)


def test_a_frozen_tower_keeps_its_weights_while_the_decoder_trains(one_rank, tmp_path):
    """frozen.params = ["^visual\\."]: after training, the tower is the one the run started
    with (the same as the full run's step-0 tower: init is by name) and the decoder moved."""
    from titan.components.checkpoint import folders as checkpoint

    argv = [*RUN[:-1], str(STEPS), "--frozen.params", r"^visual\."]
    records = run_trainer(tmp_path, 1, argv)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    frozen = checkpoint.load_dcp_model_state(tmp_path / "dump" / "checkpoint" / f"step-{STEPS}")
    _, saved = one_rank
    trained = checkpoint.load_dcp_model_state(saved / f"step-{STEPS}")
    first = checkpoint.load_dcp_model_state(saved / "step-3")
    tower = [k for k in frozen if k.startswith("visual.")]
    assert tower and all(not torch.equal(trained[k], first[k]) for k in tower[:4])
    spec = get_train_spec("qwen3_vl")
    init = built_model(spec, spec.flavors["debugmodel"], seed=42).state_dict()
    assert all(torch.equal(frozen[k], init[k]) for k in tower)
    assert not torch.equal(
        frozen["layers.0.attention.wq.weight"], init["layers.0.attention.wq.weight"]
    )


def test_an_hf_export_carries_its_processor_and_answers_about_a_picture(tmp_path, capsys):
    """checkpoint.last_save_in_hf writes the released layout with preprocessor_config.json
    (the [images] bounds the model trained at), which the generate tool reads."""
    import json

    from titan.tools.generate import main as generate_main

    argv = [*RUN[:-5], "--training.steps", "2", "--checkpoint.enable"]
    run_trainer(tmp_path, 1, [*argv, "--checkpoint.last_save_in_hf"])
    export = tmp_path / "dump" / "checkpoint" / "step-2"
    processor = json.loads((export / "preprocessor_config.json").read_text())
    assert processor["size"] == {"shortest_edge": 4096, "longest_edge": 16384}
    assert processor["patch_size"] == 8 and processor["merge_size"] == 2
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen3_vl"
    picture = "assets/images/shapes/valid/0001.png"
    generate_main(["--checkpoint", str(export), "--image", picture, "--prompt", "a"])
    assert capsys.readouterr().out.startswith("a")
