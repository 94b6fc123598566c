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


# ----------------------------------------------------------------------------- the one door


def _probe_check(job):
    from titan.config.manager import require

    require(job, job.probe.width % 2 == 0, "probe.width", "must be even")


def _probe_plan_check(job, plan):
    from titan.config.manager import require

    require(job, job.probe.width <= plan.global_batch_size, "probe.width", "above the batch")


def test_one_entry_carries_section_checks_ignored_and_copies(tmp_path):
    """Every field of an Entry is asked through the one door: its section parses and shows in
    --help, its check refuses the config, its plan check the plan, its copies are counted and
    its section's settings are ignored (named) while it is unused."""
    from dataclasses import dataclass

    from titan.config.entry import Entry
    from titan.config.job_config import opt
    from titan.plan.run_plan import plan_run

    @dataclass
    class Probe:
        width: int = opt(4, "Probe: a width, even")
        on: bool = opt(False, "Probe: used")

    @dataclass(frozen=True)
    class ProbeEntry(Entry):
        def unused(self, job):
            return None if job.probe.on else "probe.on is false"

    entry = ProbeEntry(
        "probe",
        section="probe",
        options=Probe,
        check=_probe_check,
        plan_check=_probe_plan_check,
        weight_copies=lambda sections: 2 if sections["probe"].on else 0,
    )
    extensions.register(entry)
    extensions.register(entry)  # the same entry again (a plugin imported twice): a no-op
    try:
        assert "--probe.width" in help_text([])
        assert parse_args(["--probe.on", "--probe.width", "6"]).probe.width == 6
        with pytest.raises(ConfigError, match=r"probe.width = 3 .*must be even"):
            parse_args(["--probe.on", "--probe.width", "3"])
        # unused: its checks are skipped and what the command line sets of it is ignored
        job = parse_args(["--probe.width", "3"])
        assert extensions.ignored_options(job) == {"probe.width": "probe.on is false"}
        assert extensions.weight_copies(job.extensions) == 0
        job = parse_args(["--probe.on", "--probe.width", "16", "--training.global_batch_size", "8"])
        assert extensions.weight_copies(job.extensions) == 2
        with pytest.raises(ConfigError, match="above the batch"):
            plan_run(job, 1, starting=False)
        # another entry of the kind under the same name, or another owner of the section
        with pytest.raises(ValueError, match="already registered"):
            extensions.register(ProbeEntry("probe"))
        with pytest.raises(ValueError, match="section named 'probe' is already registered"):
            extensions.register(Entry("other", section="probe", options=Probe))
    finally:
        extensions.unregister(Entry.kind, "probe")
    assert "probe" not in extensions.sections()


def test_earlier_spellings_register_entries_and_say_once_what_they_are_called_now():
    """A plugin written against earlier docs keeps working: each register_* call makes an
    Entry, with one FutureWarning naming the new spelling (once per spelling)."""
    import warnings
    from dataclasses import dataclass

    from titan.config.job_config import opt

    @dataclass
    class Old:
        size: int = opt(1, "Old: a size")

    def check(job):
        from titan.config.manager import require

        require(job, job.old.size > 0, "old.size", "must be > 0")

    extensions._said.discard("register_section(name, cls)")
    extensions._said.discard("register_check(check)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extensions.register_section("old", Old)
        extensions.register_check(check)
        extensions.unregister_check(check)
        extensions.register_check(check)  # said already
    try:
        said = [str(w.message) for w in caught if w.category is FutureWarning]
        assert said == [
            "register_section(name, cls) is now register(Entry(name, section=name, options=cls))",
            "register_check(check) is now register(Entry(name, check=check))",
        ]
        with pytest.raises(ConfigError, match="old.size = 0"):
            parse_args(["--old.size", "0"])
    finally:
        extensions.unregister_check(check)
        extensions.unregister_section("old")
    assert parse_args([]).extensions.get("old") is None


def test_a_converter_plan_check_of_earlier_docs_is_called_with_its_four_arguments():
    from titan.components.converters import ConverterSpec

    seen = []
    spec = ConverterSpec(
        "old_style",
        build="x:y",
        plan_check=lambda job, train_spec, model_args, device: seen.append(device),
    )
    plan = type("Plan", (), {"spec": None, "model_args": None, "device": "cpu"})()
    spec.plan_check(None, plan)
    assert seen == ["cpu"]
