"""Qwen3, the second family, on the common blocks: the published shapes and sizes; logits,
YaRN and both HF directions against transformers' Qwen3ForCausalLM; every layout trains like
one process; a sharded save_pretrained folder starts a run whose first loss is transformers';
convert_to_hf / convert_from_hf / generate find the family in the folder they are given."""

import importlib.util
import json
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.forked import build_trainer, built_model, free_port, run_trainer, run_workers, tiny_run
from tests.layouts import layouts
from titan.components.checkpoint import hf_io
from titan.models.qwen3.state_dict_adapter import qwen3_args_from_hf_config
from titan.models.spec import family_of_hf_config, get_train_spec
from titan.runtime.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

QWEN3 = get_train_spec("qwen3")
DEBUG = QWEN3.flavors["debugmodel"].with_updates(max_seq_len=64)
STEPS = 4
COMMON = ["--model.name", "qwen3", "--model.flavor", "debugmodel", *tiny_run(STEPS)]

# (total, non-embedding) parameters in billions as the Qwen3 model cards give them; the
# cards' non-embedding count leaves out the output matrix too
PUBLISHED = {
    "0.6B": (0.6, 0.44),
    "1.7B": (1.7, 1.4),
    "4B": (4.0, 3.6),
    "8B": (8.2, 6.95),
    "14B": (14.8, 13.2),
    "32B": (32.8, 31.2),
}


def built(args, seed=0):
    return built_model(QWEN3, args, seed)


def tokens(args, seed=1):
    return torch.randint(
        0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_sizes(flavor):
    args = QWEN3.flavors[flavor]
    total, non_embedding = PUBLISHED[flavor]
    matrices = 1 if args.tie_word_embeddings else 2
    assert args.num_params() / 1e9 == pytest.approx(total, abs=0.051)
    excluded = args.num_params() - matrices * args.vocab_size * args.dim
    assert excluded / 1e9 == pytest.approx(non_embedding, abs=0.051)
    assert args.tie_word_embeddings == (flavor in ("0.6B", "1.7B", "4B"))
    assert args.head_dim == 128 and args.vocab_size == 151936
    meta = QWEN3.build_meta(args.with_updates(n_layers=2))
    counted = sum(p.numel() for p in meta.parameters())
    assert counted == args.with_updates(n_layers=2).num_params()


def test_debug_model_has_its_own_head_dim():
    assert DEBUG.head_dim != DEBUG.dim // DEBUG.n_heads
    model = built(DEBUG)
    assert model.layers["0"].attention.wq.weight.shape == (
        DEBUG.n_heads * DEBUG.head_dim,
        DEBUG.dim,
    )
    assert model.layers["0"].attention.q_norm.weight.shape == (DEBUG.head_dim,)


def test_hf_config_round_trip_and_refusals():
    for name, args in QWEN3.flavors.items():
        config = QWEN3.state_dict_adapter(args).hf_config()
        assert family_of_hf_config(config) == "qwen3"
        back = qwen3_args_from_hf_config(config, args.max_seq_len)
        assert QWEN3.matching_flavor(back) == name
    config = QWEN3.state_dict_adapter(DEBUG).hf_config()
    with pytest.raises(
        ValueError, match="use_sliding_window.*attention_bias|attention_bias.*use_sliding_window"
    ):
        qwen3_args_from_hf_config({**config, "use_sliding_window": True, "attention_bias": True})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        qwen3_args_from_hf_config({**config, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})


@pytest.mark.needs("transformers")
@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
def test_logits_and_both_hf_directions_match_transformers(yarn, tmp_path):
    import transformers

    args = (
        DEBUG.with_updates(rope_scaling_factor=4.0, rope_original_max_len=16, rope_theta=10000.0)
        if yarn
        else DEBUG
    )
    model = built(args, seed=3)
    out = hf_io.save_hf(model.state_dict(), QWEN3, args, tmp_path / "hf")
    assert "lm_head.weight" not in hf_io.load_hf_state(out)  # tied, stored once as HF does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.Qwen3ForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, rtol=0, atol=1e-4)
    # and back, from what transformers writes (sharded)
    hf_model.save_pretrained(str(tmp_path / "from_hf"), max_shard_size="1MB")
    assert (tmp_path / "from_hf" / "model.safetensors.index.json").is_file()
    assert hf_io.args_from_hf(tmp_path / "from_hf", QWEN3, args.max_seq_len) == args
    back = hf_io.load_hf(tmp_path / "from_hf", QWEN3)
    assert set(back) == set(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    records = run_trainer(
        tmp,
        1,
        [
            *COMMON,
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(STEPS),
            "--checkpoint.last_save_model_only",
        ],
    )
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    return records, tmp / "dump" / "checkpoint" / f"step-{STEPS}"


LAYOUTS = {
    # tp2:
    # q_norm / k_norm see each rank's heads only: their gradients are summed over the ranks
    **layouts("fsdp2", "hsdp2x2", "tp2", "pp2", "cp2", "fsdp2_tp2"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_like_one_process(layout, one_rank, tmp_path):
    world, flags = LAYOUTS[layout]
    records = run_trainer(tmp_path, world, [*COMMON, *flags], deadline_s=120)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for a, b in zip(one_rank[0], records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (layout, a, b)


def first_step_against_transformers(rank, world_size, port, argv, hf_dir):
    import transformers

    trainer = build_trainer(rank, world_size, port, argv)
    seen = []
    take = trainer.next_microbatches

    def recorded(data_iter, shape):  # the batch step 1 trains on, kept as it came
        batch = take(data_iter, shape)
        seen.extend((b["input_ids"].clone(), b["labels"].clone()) for b in batch)
        return batch

    trainer.next_microbatches = recorded
    try:
        trainer.train()
    finally:
        trainer.close()
    ((inputs, labels),) = seen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager"
        )
    with torch.no_grad():
        logits = hf_model(inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    from titan.tools.loss_compare import read_metrics

    return expected, read_metrics(trainer.job.job.dump_folder)[0]["loss"]


def check_save_pretrained_start(
    tmp_path, config_cls: str, model_cls: str, args, family: str = "qwen3", prepare=None
) -> None:
    """A sharded folder that transformers' `model_cls` wrote from `args`' config (after
    `prepare(hf_model)`, if given) starts a from_hf run of `family` whose step-1 loss is
    transformers' cross-entropy on the same batch."""
    import transformers

    spec = get_train_spec(family)
    config = getattr(transformers, config_cls)(
        **{
            k: v
            for k, v in spec.state_dict_adapter(args.with_updates(max_seq_len=32))
            .hf_config()
            .items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_cls)(config)
    if prepare is not None:
        prepare(hf_model)
    hf_model.save_pretrained(str(tmp_path / "hf"), max_shard_size="2MB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    argv = [
        "--model.name",
        family,
        "--model.flavor",
        "from_hf",
        *tiny_run(1),
        "--training.local_batch_size",
        "8",
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        "--job.dump_folder",
        str(tmp_path / "dump"),
    ]
    ((expected, got),) = run_workers(
        first_step_against_transformers,
        1,
        tmp_path,
        free_port(),
        argv,
        str(tmp_path / "hf"),
        init_pg=False,
    )
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)


@pytest.mark.needs("transformers")
def test_a_save_pretrained_folder_starts_training_at_transformers_loss(tmp_path):
    check_save_pretrained_start(tmp_path, "Qwen3Config", "Qwen3ForCausalLM", DEBUG)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tools_read_the_family_from_the_folder(one_rank, tmp_path, capsys):
    """No --model-name, no --flavor: the checkpoint's record and config.json's model_type say
    it is Qwen3."""
    from titan.components.checkpoint import folders as checkpoint
    from titan.config import parse_args
    from titan.tools.generate import load_model
    from titan.tools.generate import main as generate_main

    step = one_rank[1]
    _script("convert_to_hf").main([str(step), str(tmp_path / "hf"), "--max-seq-len", "32"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == DEBUG.head_dim
    state = checkpoint.load_dcp_model_state(step)
    back = hf_io.load_hf(tmp_path / "hf", QWEN3)
    assert all(torch.equal(back[k], state[k]) for k in state)

    _script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "dcp")])
    assert "matches titan flavor 'debugmodel'" in capsys.readouterr().out
    again = checkpoint.load_dcp_model_state(tmp_path / "dcp")
    assert all(torch.equal(again[k], state[k]) for k in state)

    model, args = load_model(
        step, parse_args(["--training.seq_len", "32"]), QWEN3, 32, torch.device("cpu")
    )
    assert args.head_dim == DEBUG.head_dim and model.layers["0"].attention.q_norm is not None
    generate_main(
        [
            "--checkpoint",
            str(step),
            "--prompt",
            "In the beginning",
            "--max-new-tokens",
            "4",
            "--training.seq_len",
            "32",
        ]
    )
    assert capsys.readouterr().out.startswith("In the beginning")
