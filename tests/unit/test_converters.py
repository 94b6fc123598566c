"""Model converters: one registry for titan's (float8, the chunked loss, LoRA) and a plugin's,
switched on by name or by their own keys, checked before launch, applied before any
parallelism; a plugin's converter trains alike on 1 rank and FSDP 2."""

import sys

import pytest
import torch

from tests.example_plugin import registered
from tests.forked import run_trainer, tiny_run
from titan.components.converters import (
    Converter,
    Converters,
    ConverterSpec,
    enabled_specs,
    register_converter,
    unregister_converter,
)
from titan.config import ConfigError, parse_args
from titan.plan.run_plan import plan_run


@pytest.fixture
def freeze():
    with registered("freeze.py", "freeze", register_converter, unregister_converter) as m:
        yield m


def test_titans_converters_are_entries_switched_on_by_their_old_keys():
    assert [s.name for s in enabled_specs(parse_args([]))] == []
    job = parse_args(["--training.loss_chunk_tokens", "64", "--lora.rank", "4"])
    assert [s.name for s in enabled_specs(job)] == ["chunked_loss", "lora"]
    job = parse_args(["--model.converters", "float8", "--float8.emulate"])
    assert [s.name for s in enabled_specs(job)] == ["float8"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--model.converters", "nope"], r"model.converters = \['nope'\].*unknown \['nope'\]; "),
        (["--model.converters", "lora"], r"lora.rank = 0 .*must be > 0"),
        (["--model.converters", "chunked_loss"], "names 'chunked_loss': set the tokens"),
        (["--training.loss_chunk_tokens", "-1"], r"loss_chunk_tokens = -1 .*must be >= 0"),
        (
            ["--training.loss_chunk_tokens", "64", "--parallelism.tensor_parallel_degree", "2"],
            "is for layouts without tensor parallelism",
        ),
        (
            ["--float8.enable_fsdp_float8_all_gather", "--float8.recipe_name", "rowwise"],
            None,  # float8 is off: its section is not checked
        ),
    ],
)
def test_a_converters_config_is_checked_when_it_is_on(flags, says):
    if says is None:
        parse_args(flags)
        with pytest.raises(ConfigError, match="float8 all-gather needs recipe_name"):
            parse_args([*flags, "--model.converters", "float8"])
        return
    with pytest.raises(ConfigError, match=says):
        parse_args(flags)


class Keeps(Converter):
    """A converter whose checkpoints hold only the norms, adding a post-step hook and an
    exporter that record their calls."""

    calls: list = []

    def __init__(self, job):
        pass

    def convert(self, model):
        Keeps.calls.append("convert")

    def trained(self):
        return lambda name: "norm" in name

    def post_optimizer_hook(self, parts):
        return lambda taken: Keeps.calls.append(("hook", taken))

    def exporter(self, parts, train_spec, model_args):
        return lambda folder: Keeps.calls.append(("export", folder))


@pytest.fixture
def keeps():
    register_converter(ConverterSpec("keeps", build=f"{__name__}:Keeps"))
    Keeps.calls = []
    yield
    unregister_converter("keeps")


def test_the_run_asks_its_converters_together(keeps):
    job = parse_args(["--model.converters", "keeps"])
    converters = Converters(job)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    converters.convert(model)
    assert converters.saved(model) is model and Keeps.calls == ["convert"]  # adds nothing
    (hook,) = converters.post_optimizer_hooks([model])
    hook(True)
    converters.exporter([model], None, None)("out")
    assert Keeps.calls[1:] == [("hook", True), ("export", "out")]
    assert converters.model_state([model]).partial
    # a plugin's (order 100) applies after titan's, whatever was imported first
    both = parse_args(["--model.converters", "keeps", "--training.loss_chunk_tokens", "8"])
    assert [s.name for s in enabled_specs(both)] == ["chunked_loss", "keeps"]
    # two that each keep only their own parameters cannot share a checkpoint
    both = parse_args(["--model.converters", "keeps", "--lora.rank", "4"])
    with pytest.raises(ConfigError, match="enable one of them"):
        Converters(both)
    with pytest.raises(ConfigError, match="enable one of them"):  # before any launch
        plan_run(both, world_size=1)


def test_a_plugins_converter_is_in_help_and_checked(freeze):
    from titan.config import help_text

    assert "--freeze.modules" in help_text([])
    with pytest.raises(ConfigError, match=r"freeze.modules = \[\]: name a module"):
        parse_args(["--model.converters", "freeze", "--freeze.modules", ""])


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_a_plugins_converter_trains_alike_on_one_rank_and_fsdp2(freeze, tmp_path):
    """The example plugin freezes the embedding and the output layer: the losses of 1 rank and
    FSDP 2 agree, the frozen weights end as they were made, the rest trained, and the
    optimizer holds no state of the frozen ones."""
    from torch.distributed.checkpoint import FileSystemReader

    from titan.components.checkpoint.folders import load_dcp_model_state
    from titan.models.spec import get_train_spec

    argv = [*tiny_run(4), "--model.converters", "freeze"]
    argv += ["--checkpoint.enable", "--checkpoint.interval", "4"]
    one = run_trainer(tmp_path / "one", 1, argv)
    two = run_trainer(tmp_path / "two", 2, argv)
    assert max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(one, two, strict=True)) < 1e-5
    assert one[-1]["loss"] < one[0]["loss"]
    spec = get_train_spec("llama3")
    fresh = spec.build_meta(spec.flavors["debugmodel"])
    fresh.to_empty(device="cpu")
    fresh.init_weights(0, buffer_device=torch.device("cpu"))
    made = fresh.state_dict()
    for run in ("one", "two"):
        step = tmp_path / run / "dump" / "checkpoint" / "step-4"
        saved = load_dcp_model_state(step)
        for name in ("tok_embeddings.weight", "output.weight"):
            assert torch.equal(saved[name], made[name]), (run, name)
        assert not torch.equal(
            saved["layers.0.attention.wq.weight"], made["layers.0.attention.wq.weight"]
        )
        keys = FileSystemReader(str(step)).read_metadata().state_dict_metadata
        moments = [k for k in keys if k.startswith("optimizer.state.")]
        assert moments and not any("tok_embeddings" in k or "output." in k for k in moments)


def test_a_model_with_every_parameter_frozen_is_refused(freeze, tmp_path):
    everything = "tok_embeddings,layers,norm,output"
    argv = [*tiny_run(2), "--model.converters", "freeze", "--freeze.modules", everything]
    with pytest.raises(pytest.fail.Exception) as e:
        run_trainer(tmp_path, 1, argv)
    assert "ConfigError: no parameter of the model trains" in str(e.value)
