"""Fine-tuning with LoRA on chat data: every layout trains the adapters as one rank does, the
checkpoints hold the adapters only and resume exactly, and the base stays frozen."""

import sys

import pytest

from tests.forked import run_trainer, tiny_run
from tests.unit.test_chat_training import CHAT
from titan.components.checkpoint.folders import dcp_model_metadata
from titan.config import ConfigError, parse_args
from titan.plan.run_plan import plan_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

STEPS = 4
LORA = [
    "--lora.rank",
    "4",
    "--lora.target_modules",
    r"attention\.w[qkvo]$,feed_forward\.w[123]$",
    "--optimizer.lr",
    "1e-2",  # adapters from zero move slowly: a visible change in 4 steps
]


def argv(*extra):
    return [*tiny_run(STEPS), *CHAT, *LORA, *extra]


def losses(tmp_path, world, *extra):
    return run_trainer(tmp_path, world, argv(*extra), deadline_s=120)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """1 rank, two microbatches a step, a checkpoint every 2 steps."""
    path = tmp_path_factory.mktemp("lora_one")
    records = losses(path, 1, "--checkpoint.enable", "--checkpoint.interval", "2")
    return records, path / "dump" / "checkpoint"


def test_the_adapters_train(one_rank):
    records, _ = one_rank
    assert records[-1]["loss"] < records[0]["loss"] - 0.01


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2"],
        ["--parallelism.tensor_parallel_degree", "2"],
        ["--parallelism.pipeline_parallel_degree", "2"],
        # per-op AC recomputes the adapters' products (saved, they would cost the layer's memory)
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
        ],
    ],
    ids=["fsdp2", "tp2", "pp2", "fsdp2_op_ac"],
)
def test_layouts_train_the_same(layout, one_rank, tmp_path):
    for a, b in zip(one_rank[0], losses(tmp_path, 2, *layout), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])


def test_checkpoints_hold_the_adapters_only(one_rank):
    _, folder = one_rank
    held = dcp_model_metadata(folder / "step-2")
    assert held and all(n.endswith((".lora_a", ".lora_b")) for n in held)
    # 6 layers x 7 adapted linears, two factors each
    assert len(held) == 6 * 7 * 2
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(folder / "step-2")).read_metadata().state_dict_metadata
    moments = [k for k in keys if k.startswith("optimizer.state.")]
    assert moments and all(".lora_" in k for k in moments)


def test_an_adapters_checkpoint_reads_as_the_merged_model(one_rank, tmp_path):
    """What generate and convert_to_hf read of an adapters-only save: its base made again from
    the run's seed, the adapters folded in; equal to the merged model the run exports."""
    import torch

    from titan.components.checkpoint.folders import load_dcp_model_state, saved_model
    from titan.components.checkpoint.identity import args_in_record
    from titan.components.lora.merged import adapters_of, merged_state
    from titan.models.spec import get_train_spec

    export = ["--checkpoint.enable", "--checkpoint.last_save_model_only"]
    losses(tmp_path, 1, *export, "--checkpoint.export_dtype", "float32")
    exported = load_dcp_model_state(tmp_path / "dump" / "checkpoint" / f"step-{STEPS}")
    saved = one_rank[1] / f"step-{STEPS}"
    record, spec = saved_model(saved), get_train_spec("llama3")
    assert set(adapters_of(record)["base"]) == {"seed"}
    ours = merged_state(saved, spec, args_in_record(spec, record, 64), adapters_of(record))
    assert sorted(ours) == sorted(exported)
    assert all(torch.equal(ours[k], exported[k]) for k in ours)


def test_resume_continues_exactly(one_rank, tmp_path):
    """Steps 3-4 after resuming at step 2 (the base re-made from the seed, the adapters and
    their optimizer state from the checkpoint) are the uninterrupted run's, bit for bit."""
    first = losses(tmp_path, 1, "--checkpoint.enable", "--training.exit_at_step", "2")
    assert [r["step"] for r in first] == [1, 2]
    again = losses(tmp_path, 1, "--checkpoint.enable")
    resumed = {r["step"]: r["loss"] for r in again}
    assert resumed[3] == one_rank[0][2]["loss"] and resumed[4] == one_rank[0][3]["loss"]


def test_resume_onto_another_layout(one_rank, tmp_path):
    """The 1-rank adapters checkpoint of step 2 resumed under FSDP 2 x TP 2 (4 ranks):
    the base re-made sharded, the adapters and their moments resharded."""
    import shutil

    shutil.copytree(one_rank[1] / "step-2", tmp_path / "dump" / "checkpoint" / "step-2")
    layout = ["--parallelism.tensor_parallel_degree", "2"]
    again = run_trainer(tmp_path, 4, [*argv(), "--checkpoint.enable", *layout], deadline_s=120)
    resumed = {r["step"]: r["loss"] for r in again}
    for step in (3, 4):
        expected = one_rank[0][step - 1]["loss"]
        assert abs(resumed[step] - expected) <= 1e-5 * expected, (step, resumed, expected)


def test_the_disk_check_sizes_an_adapter_checkpoint(one_rank):
    """The save-size estimate the disk check uses is the adapters' (and their moments'), not
    the whole model's: above what was written, by less than its fixed 1 MiB margin and 2%."""
    from titan.assembly.build import training_save_bytes

    job = parse_args(argv())
    estimate = training_save_bytes(job, plan_run(job, world_size=1))
    written = sum(f.stat().st_size for f in (one_rank[1] / "step-2").iterdir())
    assert written <= estimate <= written * 1.02 + (1 << 20), (written, estimate)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lora.rank", "8"], "it holds LoRA adapters (rank 4"),
        (["--lora.rank", "0"], "this run trains the whole model"),
        # the base is not in the checkpoint: a resume must load the one the adapters know
        (["--training.seed", "7"], "trained on the weights made from seed 0"),
        (
            ["--checkpoint.initial_load_path", "assets"],
            "this run's base is the weights of",
        ),
    ],
)
def test_a_checkpoint_of_other_adapters_is_refused(one_rank, flags, says):
    from titan.assembly.build import run_identity

    job = parse_args([*argv(), *flags])
    why = run_identity(job, plan_run(job, world_size=1)).problem(one_rank[1] / "step-2")
    assert why is not None and says in why, why
    assert "resume with the [lora] settings" in why or "base they were trained on" in why


def test_the_plan_drops_the_frozen_weights_states():
    from titan.planner.memory import rank_bytes

    job = parse_args(argv())
    full = rank_bytes(job, plan_run(job, world_size=1), 0)
    job = parse_args([*tiny_run(STEPS), *CHAT])
    base = rank_bytes(job, plan_run(job, world_size=1), 0)
    assert full["params_bytes"] > base["params_bytes"]  # the adapters are added
    assert full["grads_bytes"] < base["grads_bytes"] / 10
    assert full["optimizer_bytes"] < base["optimizer_bytes"] / 10


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--lora.target_modules", "nothing$"], "match no linear layer"),
        (["--lora.rank", "-1"], "must be > 0"),
        (["--model.converters", "float8"], "float8 and LoRA"),
    ],
)
def test_refused_before_training(flags, why):
    with pytest.raises(ConfigError, match=why):
        plan_run(parse_args([*argv(), *flags]), world_size=1)


@pytest.mark.parametrize("world", [1, 2], ids=["1rank", "tp2_sp"])
def test_frozen_weights_get_no_gradient(world, tmp_path):
    """The trainer's parts after a step: only adapters hold gradients and optimizer state
    (under TP with sequence parallelism too, whose norm style remakes the norms' weights)."""
    from tests.forked import build_trainer, free_port, run_workers

    layout = ["--parallelism.tensor_parallel_degree", str(world)]

    def step(rank, world, port):
        job = [*argv(), *layout, "--job.dump_folder", str(tmp_path)]
        trainer = build_trainer(rank, world, port, job)
        try:
            shape = trainer.plan.step_shape(1)
            trainer.train_step(trainer.next_microbatches(iter(trainer.dataloader), shape), shape)
            named = [(n, p) for part in trainer.model_parts for n, p in part.named_parameters()]
            state = trainer.optimizer.state_dict()
            return {
                "with_grad": sorted(n for n, p in named if p.grad is not None),
                "trainable": sorted(n for n, p in named if p.requires_grad),
                "states": sorted({k[len("state.") :].rsplit(".", 1)[0] for k in state}),
            }
        finally:
            trainer.close()

    out = run_workers(step, world, tmp_path, free_port(), init_pg=False)[0]
    assert out["with_grad"] == out["trainable"] == out["states"]
    assert len(out["trainable"]) == 6 * 7 * 2 and all(".lora_" in n for n in out["trainable"])


# DeepSeek-V3's debug model: adapters on MLA, the shared experts and each routed expert
EXPERTS = [
    "--model.name",
    "deepseek_v3",
    "--lora.rank",
    "4",
    "--lora.target_modules",
    r"attention\.w\w*$,experts\.w[123]$",
    "--optimizer.lr",
    "1e-2",
]


@pytest.fixture(scope="module")
def experts_one_rank(tmp_path_factory):
    return run_trainer(tmp_path_factory.mktemp("lora_moe"), 1, [*tiny_run(STEPS), *EXPERTS])


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.expert_parallel_degree", "2"],
        ["--parallelism.tensor_parallel_degree", "2"],
    ],
    ids=["ep2", "tp2"],
)
def test_routed_expert_adapters_train_alike(layout, experts_one_rank, tmp_path):
    assert experts_one_rank[-1]["loss"] < experts_one_rank[0]["loss"] - 0.01
    other = run_trainer(tmp_path, 2, [*tiny_run(STEPS), *EXPERTS, *layout], deadline_s=120)
    for a, b in zip(experts_one_rank, other, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
