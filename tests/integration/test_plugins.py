"""A plugin from outside the tree (tests/plugins/titan_plugin_example: a family, an optimizer,
a metrics writer, a callback, an objective term and a model converter, each with its own
config section, and a dataset name) trains through ./run_train.sh --job.custom_import, on 1
rank and FSDP 2, and nothing in titan/ knows its names."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.harness import COMMON, dp_batch, launch, losses
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
    "--z_loss.weight",
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
        "ZLossOptions",
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
        "--z_loss.weight",
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


def test_plugin_trains_on_one_rank_and_fsdp2_alike(tmp_path):
    one, two = tmp_path / "one", tmp_path / "fsdp2"
    # the dataset by the name the plugin gives the bundled corpus (the FSDP run reads kjv)
    launch(
        1,
        [*COMMON, *dp_batch(1), *PLUGIN, "--training.dataset", "plugin_corpus"],
        one,
        env=ENV,
        timeout=300,
    )
    # the plugin's .py file, named in a TOML file rather than on the command line
    config = tmp_path / "plugin.toml"
    plugin_file = PLUGINS / "titan_plugin_example" / "__init__.py"
    config.write_text(
        (REPO / "train_configs" / "debug_model.toml")
        .read_text()
        .replace("[job]\n", f'[job]\ncustom_import = ["{plugin_file}"]\n', 1)
    )
    launch(
        2, [*COMMON, *dp_batch(2), *PLUGIN[2:]], two, env=ENV, timeout=300, config_file=str(config)
    )
    a, b = losses(one), losses(two)
    assert a[len(a)] < a[1] - 0.1  # SGD trains the GELU family (8.16 -> 7.88 measured)
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5
    # the plugin's objective term, logged by its name, the same on both layouts
    za, zb = ({r["step"]: r["z_loss"] for r in read_metrics(d)} for d in (one, two))
    assert za.keys() == a.keys() and max(abs(za[s] - zb[s]) / za[s] for s in za) < 1e-5
    with open(one / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["train/loss"]) for r in rows] == [a[s] for s in sorted(a)]
    # the callback's running average of each run's losses, every step
    for dump, got in ((one, a), (two, b)):
        lines = [json.loads(x) for x in (dump / "loss_ema.jsonl").read_text().splitlines()]
        average, expected = None, []
        for step in sorted(got):
            loss = got[step]
            average = loss if average is None else 0.9 * average + (1 - 0.9) * loss
            expected.append({"step": step, "loss_ema": average})
        assert lines == expected
