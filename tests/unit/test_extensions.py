"""Plugins by --job.custom_import (a dotted module or a .py path, on the command line or in
the config file) add config sections and checks that parse, show in --help and fail like
titan's own; a plugin that cannot be found is one line."""

import sys

import pytest

from titan.config import ConfigError, extensions, help_text, parse_args

PLUGIN = """
from dataclasses import dataclass

from titan.config import extensions
from titan.config.job_config import opt


@dataclass
class ProbeOptions:
    width: int = opt(4, "Probe: a width, even")


def check(job):
    from titan.config.manager import require

    require(job, job.probe.width % 2 == 0, "probe.width", "must be even")


extensions.register_section("probe", ProbeOptions)
extensions.register_check(check)
"""


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "probe_plugin.py"
    path.write_text(PLUGIN)
    yield str(path)
    module = sys.modules.pop("titan_plugin_probe_plugin", None)
    extensions.unregister_section("probe")
    if module:
        extensions.unregister_check(module.check)


def test_a_py_plugin_adds_a_section_parsed_checked_and_in_help(plugin):
    job = parse_args(["--job.custom_import", plugin, "--probe.width", "6"])
    assert job.probe.width == 6 and job.job.custom_import == [plugin]
    with pytest.raises(ConfigError, match=r"probe.width = 3 \(from command line"):
        parse_args(["--job.custom_import", plugin, "--probe.width", "3"])
    assert "--probe.width" in help_text(["--job.custom_import", plugin])


def test_a_plugin_named_in_the_config_file_is_imported_before_its_sections_are_read(
    plugin, tmp_path
):
    config = tmp_path / "run.toml"
    config.write_text(f'[job]\ncustom_import = ["{plugin}"]\n[probe]\nwidth = 8\n')
    assert parse_args(["--job.config_file", str(config)]).probe.width == 8


@pytest.mark.parametrize(
    "name,words",
    [
        ("no_such_module_anywhere", "no module 'no_such_module_anywhere' on sys.path"),
        ("/nowhere/plugin.py", "no such file"),
    ],
)
def test_a_missing_plugin_is_one_line(name, words):
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.custom_import", name])
    assert f"job.custom_import {name!r}" in str(e.value) and words in str(e.value)


def test_plugins_are_found_before_parsing():
    argv = ["--job.custom_import=a,b", "--training.steps", "3", "--job.custom_import", "c"]
    assert extensions.plugins_in(argv) == ["a", "b", "c"]
