"""A plugin from outside the tree (tests/plugins/titan_plugin_example: a family, an optimizer,
a metrics writer, a callback, an objective term and a model converter, each with its own
config section, and a dataset whose batch field the family reads) trains through
./run_train.sh --job.custom_import on 1 rank, FSDP 2, TP 2 and PP 2 to the same losses and
resumes bit for bit, and nothing in titan/ knows its names."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.harness import COMMON, dp_batch, launch, losses
from titan.components.checkpoint.folders import load_dcp_model_state
from titan.tools.loss_compare import read_metrics

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "plugins"
ENV = {"PYTHONPATH": f"{PLUGINS}:{os.environ.get('PYTHONPATH', '')}"}
PLUGIN = [
    "--job.custom_import",
    "titan_plugin_example",
    "--model.name",
    "gelu_llama",
    "--model.flavor",
    "tiny",
    "--optimizer.name",
    "SGD",
    "--optimizer.lr",
    "0.05",
    "--sgd.momentum",
    "0.8",
    "--csv_metrics.enable",
    "--loss_ema.enable",
    "--logit_l2.weight",
    "1e-4",
    # SGD learns slower than the harness's AdamW: 10 steps show it
    "--training.steps",
    "10",
]


def test_titan_does_not_know_the_plugin():
    names = (
        "titan_plugin_example",
        "gelu_llama",
        "csv_metrics",
        "SGDOptions",
        "CsvWriter",
        "plugin_corpus",
        "loss_ema",
        "LossEma",
        "FreezeOptions",
        "LogitL2Options",
    )
    for path in (REPO / "titan").rglob("*.py"):
        text = path.read_text()
        assert not any(n in text for n in names), path


def test_the_plugins_sections_are_in_help_and_checked():
    env = {**os.environ, **ENV}
    run = [sys.executable, "-m", "titan.trainer", "--job.custom_import", "titan_plugin_example"]
    proc = subprocess.run(
        [*run, "--help"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for line in (
        "[sgd]",
        "--sgd.momentum",
        "[csv_metrics]",
        "--csv_metrics.file",
        "[gelu_llama]",
        "--loss_ema.beta",
        "--freeze.modules",
        "--logit_l2.weight",
    ):
        assert line in proc.stdout, line
    proc = subprocess.run(
        [*run, "--optimizer.name", "SGD", "--sgd.momentum", "1.5"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("titan: config error: sgd.momentum = 1.5 (from command line")
    )
    proc = subprocess.run(
        [*run[:-1], "no_such_plugin"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "job.custom_import 'no_such_plugin': no module" in (proc.stderr)


def _series(dump, key):
    return {r["step"]: r[key] for r in read_metrics(dump)}


def _ema_lines(dump):
    return [json.loads(x) for x in (dump / "loss_ema.jsonl").read_text().splitlines()]


@pytest.mark.slow("five launches: the plugin on 1 rank, FSDP 2, TP 2, PP 2, and FSDP 2 resumed")
def test_the_plugin_trains_alike_on_every_layout_and_resumes_bitwise(tmp_path):
    """Everything the plugin adds at once: its family reading its dataset's batch field
    (`positions`), its converter (frozen embedding and output), its objective term (z-loss)
    and its callback (the loss's running average), with its optimizer and metrics writer."""
    proof = [*COMMON, *PLUGIN[2:], "--model.converters", "freeze"]
    proof += ["--training.dataset", "plugin_corpus"]
    layouts = {
        "one": (1, dp_batch(1)),
        "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", *dp_batch(1)]),
        "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", *dp_batch(1)]),
    }
    for name, (nproc, layout) in layouts.items():
        launch(nproc, [*PLUGIN[:2], *proof, *layout], tmp_path / name, env=ENV, timeout=300)
    # FSDP 2 names the plugin's .py file in a TOML file rather than on the command line
    config = tmp_path / "plugin.toml"
    plugin_file = PLUGINS / "titan_plugin_example" / "__init__.py"
    config.write_text(
        (REPO / "train_configs" / "debug_model.toml")
        .read_text()
        .replace("[job]\n", f'[job]\ncustom_import = ["{plugin_file}"]\n', 1)
    )
    saving = [*proof, *dp_batch(2), "--checkpoint.enable", "--checkpoint.interval", "5"]
    launch(2, saving, tmp_path / "fsdp2", env=ENV, timeout=300, config_file=str(config))

    a = losses(tmp_path / "one")
    assert sorted(a) == list(range(1, 11)) and a[10] < a[1] - 0.1  # SGD trains the family
    z_one = _series(tmp_path / "one", "logit_l2")
    for name in ("fsdp2", "tp2", "pp2"):
        b, z = losses(tmp_path / name), _series(tmp_path / name, "logit_l2")
        assert b.keys() == a.keys(), name
        assert max(abs(a[s] - b[s]) / a[s] for s in a) < 1e-5, name
        assert max(abs(z_one[s] - z[s]) / z_one[s] for s in z_one) < 1e-5, name
    with open(tmp_path / "one" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["train/loss"]) for r in rows] == [a[s] for s in sorted(a)]
    # the callback's running average of each run's own losses, every step
    for name in ("one", "fsdp2"):
        got, average, expected = losses(tmp_path / name), None, []
        for step in sorted(got):
            loss = got[step]
            average = loss if average is None else 0.9 * average + (1 - 0.9) * loss
            expected.append({"step": step, "loss_ema": average})
        assert _ema_lines(tmp_path / name) == expected
    # the converter: the frozen weights are in the checkpoints as they were made
    early, late = (
        load_dcp_model_state(tmp_path / "fsdp2" / "checkpoint" / f"step-{s}") for s in (5, 10)
    )
    for key in ("tok_embeddings.weight", "output.weight"):
        assert torch.equal(early[key], late[key]), key
    assert not torch.equal(
        early["layers.0.attention.wq.weight"], late["layers.0.attention.wq.weight"]
    )

    # a new job resumes FSDP 2's step-5 checkpoint: every figure after it bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp2" / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    proc = launch(
        2,
        [*saving, "--checkpoint.load_step", "5"],
        resumed,
        env=ENV,
        timeout=300,
        config_file=str(config),
    )
    assert "resumed from" in proc.stdout + proc.stderr
    straight = read_metrics(tmp_path / "fsdp2")
    after = read_metrics(resumed)
    assert [r["step"] for r in after] == list(range(6, 11))
    for key in ("loss", "logit_l2", "grad_norm"):
        assert [r[key] for r in after] == [r[key] for r in straight[5:]], key
    assert _ema_lines(resumed) == _ema_lines(tmp_path / "fsdp2")[5:]
