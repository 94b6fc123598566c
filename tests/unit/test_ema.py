"""[ema]: the average of the weights against one computed offline from every step's weights, on
every layout, across a resume, in validation and in the final export."""

import json
from pathlib import Path

import pytest
import torch

from tests.forked import TWO_RANK_LAYOUTS, run_trainer, tiny_run
from titan.components.checkpoint.folders import load_dcp_model_state

EMA = ["--ema.enable", "--ema.decay", "0.9", "--ema.start_step", "2", "--ema.every", "2"]
EVERY_STEP = [
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1",
    "--checkpoint.keep_latest_k",
    "0",
]
VALIDATE = [
    *("--validation.enable", "--validation.freq", "3", "--validation.steps", "2"),
    *("--validation.global_batch_size", "4"),  # the same sequences on every layout
]
STEPS = 6


def averages(step: Path) -> dict[str, torch.Tensor]:
    """The average a training checkpoint holds, whole, by parameter name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step.parent / f"{step.name}.pt"
    if not out.exists():
        dcp_to_torch_save(str(step), str(out))
    return torch.load(out, weights_only=True)["train_state"]["callbacks"]["ema"]


def val_losses(dump: Path) -> list[float]:
    lines = (dump / "validation.jsonl").read_text().splitlines()
    return [json.loads(x)["val_loss"] for x in lines]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """6 steps with a checkpoint at each, the average validated; and the same without [ema]."""
    tmp = tmp_path_factory.mktemp("ema")
    plain = run_trainer(tmp / "plain", 1, [*tiny_run(STEPS), *VALIDATE], deadline_s=120)
    argv = [*tiny_run(STEPS), *EMA, *EVERY_STEP, *VALIDATE, "--validation.use_ema"]
    rows = run_trainer(tmp / "ema", 1, argv, deadline_s=120)
    return plain, rows, tmp / "ema" / "dump", tmp / "plain" / "dump"


def test_the_average_is_the_offline_one_and_training_is_untouched(one_rank):
    plain, rows, dump, plain_dump = one_rank
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]  # bitwise
    root = dump / "checkpoint"
    weights = [load_dcp_model_state(root / f"step-{s}") for s in range(1, STEPS + 1)]
    offline = {}
    for step, w in enumerate(weights, start=1):  # start 2, every 2, decay 0.9
        if step < 2:
            offline = {n: t.double() for n, t in w.items()}
        elif (step - 2) % 2 == 0:
            offline = {n: 0.9 * offline[n] + 0.1 * w[n].double() for n in w}
    got = averages(root / f"step-{STEPS}")
    assert got.keys() == offline.keys()
    for name, value in got.items():
        torch.testing.assert_close(value.double(), offline[name], rtol=1e-6, atol=1e-7)
    # the average differs from the weights, and validation saw it
    assert val_losses(dump) != val_losses(plain_dump)


LAYOUTS = TWO_RANK_LAYOUTS


@pytest.mark.slow("a 2-rank training of 6 steps with checkpoints")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_averages_as_one_rank(one_rank, tmp_path, layout):
    _, rows, dump, _ = one_rank
    ck = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
    argv = [*tiny_run(STEPS), *EMA, *ck, *VALIDATE, "--validation.use_ema", *LAYOUTS[layout]]
    got_rows = run_trainer(tmp_path, 2, argv, deadline_s=180)
    for a, b in zip(rows, got_rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert val_losses(tmp_path / "dump") == pytest.approx(val_losses(dump), rel=1e-5)
    want, got = (averages(d / "checkpoint" / f"step-{STEPS}") for d in (dump, tmp_path / "dump"))
    assert got.keys() == want.keys()
    for name, value in want.items():
        # weights of ~0.02: an element near 0 differs by a few 1e-6 as the losses by 1e-5
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5)


def test_a_resume_continues_the_average_bitwise(one_rank, tmp_path):
    import shutil

    _, rows, dump, _ = one_rank
    shutil.copytree(dump / "checkpoint" / "step-3", tmp_path / "dump" / "checkpoint" / "step-3")
    argv = [*tiny_run(STEPS), *EMA, *EVERY_STEP, *VALIDATE, "--validation.use_ema"]
    resumed = run_trainer(tmp_path, 1, argv, deadline_s=120)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows[3:]]
    want, got = (averages(d / "checkpoint" / f"step-{STEPS}") for d in (dump, tmp_path / "dump"))
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A run whose last save is an HF export of the average (checkpoint.export_ema)."""
    tmp = tmp_path_factory.mktemp("export")
    ck = ["--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.last_save_in_hf"]
    run_trainer(tmp, 1, [*tiny_run(STEPS), *EMA, *ck, "--checkpoint.export_ema"], deadline_s=120)
    (export,) = (tmp / "dump" / "checkpoint").glob(f"step-{STEPS}")
    return export


def _titan_model(export):
    from titan.tools import generate as gen

    job, path, spec, _ = gen.open_checkpoint(str(export), [])
    model, _ = gen.load_model(path, job, spec, 32, torch.device("cpu"))
    return model


def test_the_final_export_holds_the_average(one_rank, exported):
    """checkpoint.export_ema: the last save (HF) holds the average, as titan reads it."""
    _, _, dump, _ = one_rank
    model = _titan_model(exported)
    want = averages(dump / "checkpoint" / f"step-{STEPS}")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


@pytest.mark.needs("transformers")
def test_the_exported_average_loads_in_transformers(exported):
    from transformers import AutoModelForCausalLM

    model, hf = _titan_model(exported), AutoModelForCausalLM.from_pretrained(exported)
    tokens = torch.tensor([[1, 17, 230, 5, 99]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-4)


def test_memory_and_disk_count_the_average():
    from titan.components.checkpoint.disk_space import save_bytes
    from titan.config import parse_args
    from titan.plan.run_plan import plan_run
    from titan.planner.memory import rank_bytes

    plain, ema = (parse_args(["--training.seq_len", "32", *x]) for x in ([], ["--ema.enable"]))
    a, b = (rank_bytes(j, plan_run(j, 1), 0) for j in (plain, ema))
    assert a["copies_bytes"] == 0 and b["copies_bytes"] == b["params_bytes"]  # float32 weights
    assert b["states_bytes"] == a["states_bytes"] + b["params_bytes"]
    shapes = [("w", (1000, 1000))]
    grow = save_bytes(shapes, ema.optimizer, ema.extensions) - save_bytes(
        shapes, plain.optimizer, plain.extensions
    )
    assert grow >= 4 * 10**6  # a float32 copy of the weight


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--validation.use_ema"],
            r"validation.use_ema = True .*needs the average: set ema.enable",
        ),
        (["--eval.use_ema"], r"eval.use_ema = True .*needs the average: set ema.enable"),
        (
            ["--ema.enable", "--checkpoint.export_ema"],
            r"checkpoint.export_ema = True .*the last save must be an export",
        ),
        (["--ema.enable", "--ema.decay", "1"], r"ema.decay = 1.0 .*must be in \(0, 1\)"),
    ],
)
def test_bad_ema_settings_are_config_errors(flags, message):
    from titan.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(flags)


@pytest.mark.needs("lm_eval")
@pytest.mark.slow("two 4-step trainings that evaluate once")
def test_in_loop_evaluation_scores_the_average(tmp_path):
    evals = ["--eval.tasks", "kjv_bits_per_byte", "--eval.limit", "2", "--eval.freq", "4"]
    scores = []
    for name, extra in (("weights", []), ("average", ["--eval.use_ema"])):
        rows = run_trainer(tmp_path / name, 1, [*tiny_run(4), *EMA, *evals, *extra])
        line = (tmp_path / name / "dump" / "eval.jsonl").read_text().splitlines()[-1]
        scores.append((json.loads(line)["kjv_bits_per_byte/bits_per_byte"], rows))
    (plain, rows_plain), (averaged, rows_averaged) = scores
    assert averaged != plain
    assert [r["loss"] for r in rows_plain] == [r["loss"] for r in rows_averaged]


def test_the_average_starts_from_the_weights_training_starts_from(one_rank, tmp_path):
    """From an initial load (the checkpoint of step 6, model only), decay 0.5 from step 1:
    after one step the average is half the loaded weights and half the new ones."""
    _, _, dump, _ = one_rank
    loaded = dump / "checkpoint" / f"step-{STEPS}"
    ema = ["--ema.enable", "--ema.decay", "0.5", "--ema.start_step", "1"]
    start = ["--checkpoint.initial_load_path", str(loaded), "--checkpoint.initial_load_model_only"]
    ck = ["--checkpoint.enable", "--checkpoint.interval", "1"]
    run_trainer(tmp_path, 1, [*tiny_run(1), *ema, *start, *ck], deadline_s=120)
    step1 = tmp_path / "dump" / "checkpoint" / "step-1"
    w0, w1 = load_dcp_model_state(loaded), load_dcp_model_state(step1)
    got = averages(step1)
    for name, value in got.items():
        want = 0.5 * w0[name].double() + 0.5 * w1[name].double()
        torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-7)
