"""The config gate: problems that used to surface inside workers are refused by plan_run
(which the launcher runs before torchrun), each with one message naming the key."""

import pytest

from titan.config import ConfigError, parse_args
from titan.plan.run_plan import plan_run


def refused(*argv, world_size=1) -> str:
    with pytest.raises(ConfigError) as e:
        plan_run(parse_args(list(argv)), world_size=world_size)
    return str(e.value)


def test_selective_ac_option_is_checked_with_the_config():
    with pytest.raises(ConfigError) as e:
        parse_args(
            [
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "every2",
            ]
        )
    assert "activation_checkpoint.selective_ac_option = 'every2'" in str(e.value)
    assert "'op'" in str(e.value) and "positive integer" in str(e.value)
    parse_args(["--activation_checkpoint.selective_ac_option", "op"])
    parse_args(["--activation_checkpoint.selective_ac_option", "3"])


def test_missing_local_dataset_path(tmp_path):
    missing = str(tmp_path / "corpus.jsonl")
    msg = refused("--training.dataset_path", missing)
    assert missing in msg and "training.dataset_path" in msg
    msg = refused("--validation.enable", "--validation.dataset_path", missing)
    assert missing in msg and "validation.dataset_path" in msg
    plan_run(parse_args(["--validation.dataset_path", missing]), world_size=1)  # not enabled


@pytest.mark.parametrize(
    "dataset",
    [["--training.dataset_streaming"], ["--training.dataset", "allenai/c4:en"]],
    ids=["local_streamed", "hub"],
)
def test_fault_tolerance_refuses_streamed_datasets(dataset):
    msg = refused("--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *dataset)
    assert "fault_tolerance.enable" in msg and "streamed" in msg and "global index" in msg


def test_cuda_device_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    msg = refused("--training.device", "cuda")
    assert "training.device = 'cuda'" in msg and "no GPU is visible" in msg
    msg = refused("--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem")
    assert "checkpoint.async_mode" in msg and "CUDA" in msg


@pytest.mark.gpu
def test_cuda_is_picked_when_present(tmp_path):
    import torch

    from titan.runtime.distributed import pick_device

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert pick_device().type == "cuda" and pick_device("cpu").type == "cpu"
    plan_run(
        parse_args(
            [
                "--checkpoint.enable",
                "--checkpoint.async_mode",
                "async_with_pinned_mem",
                "--job.dump_folder",
                str(tmp_path),
            ]
        ),
        world_size=1,
    )


# ----------------------------------------------------------------------------- HF starts


def _hf_folder(tmp_path, args):
    from titan.components.checkpoint import hf_io
    from titan.models.spec import get_train_spec

    llama = get_train_spec("llama3")
    model = llama.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return hf_io.save_hf(model.state_dict(), llama, args, tmp_path / "hf")


def test_hf_initial_loads_are_checked_against_the_flavor(tmp_path):
    from titan.models.llama3.args import LLAMA3_FLAVORS

    other = LLAMA3_FLAVORS["debugmodel"].with_updates(n_layers=2, n_kv_heads=4, vocab_size=2048)
    hf = str(_hf_folder(tmp_path, other))
    load = ["--checkpoint.initial_load_path", hf, "--checkpoint.initial_load_in_hf"]
    msg = refused(*load)  # flavor debugmodel: 6 layers, 8 kv heads
    assert "n_layers 2 vs 6" in msg and "n_kv_heads 4 vs 8" in msg and 'flavor = "from_hf"' in msg
    # from_hf takes the HF model's shape
    plan = plan_run(parse_args([*load, "--model.flavor", "from_hf"]), world_size=1)
    assert (plan.model_args.n_layers, plan.model_args.n_kv_heads) == (2, 4)
    msg = refused("--model.flavor", "from_hf")
    assert "model.flavor = 'from_hf'" in msg and "initial_load_path" in msg
    msg = refused("--checkpoint.initial_load_path", str(tmp_path / "nowhere"))
    assert "checkpoint.initial_load_path" in msg and "no such folder" in msg
    msg = refused("--checkpoint.last_save_in_hf")
    assert "checkpoint.last_save_in_hf" in msg and "checkpoint.enable" in msg
    small = tmp_path / "small"
    small.mkdir()
    small_hf = _hf_folder(small, other.with_updates(vocab_size=1000))
    msg = refused(
        "--checkpoint.initial_load_path",
        str(small_hf),
        "--checkpoint.initial_load_in_hf",
        "--model.flavor",
        "from_hf",
    )
    assert "2048 tokens" in msg and "only 1000" in msg
