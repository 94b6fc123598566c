"""Config: defaults < TOML < CLI, every CLI form, and every error path's message."""

import dataclasses
import subprocess
import sys

import pytest
import tomllib

from titan.components.optim.optimizer_spec import ParamGroup
from titan.config import ConfigError, JobConfig, help_text, parse_args, to_toml
from titan.config.manager import _coerce, source_of


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def sections(cfg):
    """The config's sections (its dataclass fields; `sources` is bookkeeping, not a section)."""
    return {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, f.name))
    }


# ----------------------------------------------------------------------------- defaults


def test_defaults_equal_dataclass_defaults():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.training.steps == 10000
    assert cfg.training.seq_len == 2048
    assert cfg.training.dataset_shuffle is True
    assert cfg.training.dataset_path is None
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.optimizer.name == "AdamW"
    assert cfg.optimizer.lr == pytest.approx(8e-4)
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert source_of(cfg, "training.steps") == "the default"


def test_default_list_and_dict_fields_are_not_shared():
    a, b = JobConfig(), JobConfig()
    for sa, sb in zip(sections(a).values(), sections(b).values()):
        assert sa is not sb


def test_config_package_does_not_import_torch():
    code = "import sys, titan.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- TOML


def test_toml_loading(tmp_path):
    path = write(
        tmp_path,
        """
[training]
steps = 123
seq_len = 256
dataset_shuffle = false
max_norm = 2          # an int is accepted for a float field
dataset_path = "data/x.jsonl"

[optimizer]
name = "Adam"
lr = 3e-4

[lr_scheduler]
decay_ratio = 0.25
decay_type = "cosine"
""",
    )
    cfg = parse_args(["--job.config_file", path])
    assert cfg.job.config_file == path
    assert cfg.training.steps == 123
    assert cfg.training.seq_len == 256
    assert cfg.training.dataset_shuffle is False
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.training.dataset_path == "data/x.jsonl"
    assert cfg.optimizer.name == "Adam"
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.lr_scheduler.decay_ratio == pytest.approx(0.25)
    assert cfg.lr_scheduler.decay_type == "cosine"
    # untouched keys keep their defaults
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size
    assert source_of(cfg, "training.steps") == f"config file {path}"


def test_config_file_with_equals_form(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\n")
    assert parse_args([f"--job.config_file={path}"]).training.steps == 7


# ----------------------------------------------------------------------------- CLI forms


def test_cli_space_and_equals_forms():
    assert parse_args(["--training.steps", "20"]).training.steps == 20
    assert parse_args(["--training.steps=20"]).training.steps == 20
    cfg = parse_args(["--optimizer.lr", "1e-3", "--training.seq_len=64", "--model.flavor", "8B"])
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.training.seq_len == 64
    assert cfg.model.flavor == "8B"


def test_cli_float_field_accepts_int_text():
    cfg = parse_args(["--training.max_norm", "3"])
    assert cfg.training.max_norm == 3.0 and isinstance(cfg.training.max_norm, float)


def test_cli_negative_number_is_a_value():
    cfg = parse_args(["--training.global_batch_size", "-1", "--training.steps", "3"])
    assert cfg.training.global_batch_size == -1
    assert cfg.training.steps == 3


def test_bool_flags(tmp_path):
    off = write(tmp_path, "[training]\ndataset_shuffle = false\n")
    # bare flag turns a bool on (at the end of argv and before another flag)
    assert (
        parse_args(
            ["--job.config_file", off, "--training.dataset_shuffle"]
        ).training.dataset_shuffle
        is True
    )
    cfg = parse_args(
        ["--job.config_file", off, "--training.dataset_shuffle", "--training.steps", "5"]
    )
    assert cfg.training.dataset_shuffle is True and cfg.training.steps == 5
    # no_ prefix turns it off
    assert parse_args(["--training.no_dataset_shuffle"]).training.dataset_shuffle is False
    cfg = parse_args(["--training.no_dataset_shuffle", "--training.steps", "5"])
    assert cfg.training.dataset_shuffle is False and cfg.training.steps == 5


@pytest.mark.parametrize(
    "text,expected",
    [
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
    ],
)
def test_bool_equals_values(text, expected):
    cfg = parse_args([f"--metrics.enable_tensorboard={text}"])
    assert cfg.metrics.enable_tensorboard is expected
    cfg = parse_args(["--compile.enable", text])  # space form takes a value too
    assert cfg.compile.enable is expected


def test_bool_bad_value():
    with pytest.raises(ConfigError) as e:
        parse_args(["--compile.enable=maybe"])
    assert "compile.enable" in str(e.value) and "command line" in str(e.value)


def test_negated_flag_takes_no_value():
    with pytest.raises(ConfigError, match="no_dataset_shuffle"):
        parse_args(["--training.no_dataset_shuffle=true"])


def test_optional_fields_set_to_none(tmp_path):
    path = write(
        tmp_path, '[training]\ndataset_path = "x.jsonl"\n[lr_scheduler]\ndecay_ratio = 0.2\n'
    )
    cfg = parse_args(["--job.config_file", path])
    assert cfg.training.dataset_path == "x.jsonl" and cfg.lr_scheduler.decay_ratio == 0.2
    cfg = parse_args(
        [
            "--job.config_file",
            path,
            "--training.dataset_path",
            "None",
            "--lr_scheduler.decay_ratio=none",
        ]
    )
    assert cfg.training.dataset_path is None
    assert cfg.lr_scheduler.decay_ratio is None
    assert parse_args(["--lr_scheduler.decay_ratio", "null"]).lr_scheduler.decay_ratio is None
    assert parse_args(["--lr_scheduler.decay_ratio", "0.3"]).lr_scheduler.decay_ratio == 0.3


def test_none_for_non_optional_int_is_rejected():
    with pytest.raises(ConfigError, match="training.steps"):
        parse_args(["--training.steps", "None"])


def test_list_coercion_helper():
    # job_config has no list field today; the coercion for one is exercised directly
    cli = "command line '--x.y 1,2,3'"
    assert _coerce("1,2,3", list[int], "x.y", cli) == [1, 2, 3]
    assert _coerce(" 4 , 5 ,", list[int], "x.y", cli) == [4, 5]
    assert _coerce("", list[int], "x.y", cli) == []
    assert _coerce("a,b", list[str], "x.y", cli) == ["a", "b"]
    assert _coerce([1, 2], list[int], "x.y", "config file f.toml") == [1, 2]
    assert _coerce([1, 2], list[float], "x.y", "config file f.toml") == [1.0, 2.0]
    with pytest.raises(ConfigError) as e:
        _coerce("1,x", list[int], "x.y", cli)
    assert "x.y" in str(e.value) and "command line" in str(e.value)
    with pytest.raises(ConfigError, match="config file f.toml"):
        _coerce(5, list[int], "x.y", "config file f.toml")
    with pytest.raises(ConfigError):  # TOML strings inside a list[int] are not converted
        _coerce(["1", "2"], list[int], "x.y", "config file f.toml")
    assert _coerce("None", list[int] | None, "x.y", cli) is None


def test_coerce_strictness_outside_cli():
    toml = "config file f.toml"
    assert _coerce(3, float, "a.b", toml) == 3.0
    for value, tp in [
        ("3", int),
        ("3.0", float),
        ("true", bool),
        (True, int),
        (True, float),
        (2.5, int),
        (1, bool),
        (5, str),
    ]:
        with pytest.raises(ConfigError):
            _coerce(value, tp, "a.b", toml)


# ----------------------------------------------------------------------------- precedence


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 50\nseq_len = 128\n")
    cfg = parse_args(["--training.steps", "20", "--job.config_file", path])
    assert cfg.training.steps == 20  # CLI beats TOML, whatever the argv order
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.training.local_batch_size == 8  # default
    assert source_of(cfg, "training.steps").startswith("command line")
    assert source_of(cfg, "training.seq_len") == f"config file {path}"
    assert source_of(cfg, "training.local_batch_size") == "the default"


def test_last_cli_value_wins():
    assert parse_args(["--training.steps", "1", "--training.steps=2"]).training.steps == 2


# ----------------------------------------------------------------------------- errors


def assert_config_error(argv, *fragments):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    msg = str(e.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


def test_unknown_section_cli():
    assert_config_error(
        ["--trainng.steps", "5"],
        "unknown config section 'trainng'",
        "did you mean 'training'",
        "command line",
    )


def test_unknown_section_toml(tmp_path):
    path = write(tmp_path, "[optimzer]\nlr = 0.1\n")
    assert_config_error(
        ["--job.config_file", path], "'optimzer'", "did you mean 'optimizer'", f"config file {path}"
    )


def test_unknown_key_cli():
    assert_config_error(
        ["--training.stpes=5"],
        "unknown config key 'training.stpes'",
        "did you mean 'training.steps'",
        "command line",
    )


def test_unknown_key_toml(tmp_path):
    path = write(tmp_path, "[training]\nseqlen = 64\n")
    assert_config_error(
        ["--job.config_file", path],
        "'training.seqlen'",
        "did you mean 'training.seq_len'",
        f"config file {path}",
    )


def test_unknown_bool_negation_is_unknown_key():
    assert_config_error(["--training.no_such_flag"], "training.no_such_flag")


def test_key_without_section():
    assert_config_error(["--steps", "5"], "'steps'", "section.key")


def test_positional_argument():
    assert_config_error(["train.toml"], "unexpected argument 'train.toml'")


@pytest.mark.parametrize(
    "argv,value",
    [
        (["--training.steps", "ten"], "'ten'"),
        (["--training.steps=2.5"], "'2.5'"),  # float for int
        (["--optimizer.lr", "fast"], "'fast'"),
    ],
)
def test_wrong_type_cli(argv, value):
    key = argv[0][2:].split("=")[0]
    msg = assert_config_error(argv, key, value, "command line", "is not a valid")
    assert ("int" in msg) or ("float" in msg)


@pytest.mark.parametrize(
    "line,key",
    [
        ('steps = "ten"', "training.steps"),
        ("steps = 2.5", "training.steps"),  # float for int
        ("steps = true", "training.steps"),  # bool is not an int
        ('max_norm = "1.0"', "training.max_norm"),  # TOML strings are not converted
        ("dataset_shuffle = 1", "training.dataset_shuffle"),
        ("dataset = 5", "training.dataset"),
    ],
)
def test_wrong_type_toml(tmp_path, line, key):
    path = write(tmp_path, f"[training]\n{line}\n")
    assert_config_error(["--job.config_file", path], key, f"config file {path}", "is not a valid")


def test_bad_literal_cli():
    assert_config_error(
        ["--optimizer.name", "adamw"],
        "optimizer.name",
        "'adamw'",
        "command line",
        "AdamW, Adam",
        "did you mean 'AdamW'",
    )


def test_bad_literal_toml(tmp_path):
    path = write(tmp_path, '[lr_scheduler]\ndecay_type = "cosin"\n')
    assert_config_error(
        ["--job.config_file", path],
        "lr_scheduler.decay_type",
        f"config file {path}",
        "did you mean 'cosine'",
    )


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.toml")
    assert_config_error(
        ["--job.config_file", missing], missing, "does not exist", "--job.config_file"
    )


def test_invalid_toml_syntax(tmp_path):
    path = write(tmp_path, "[training\nsteps = 5\n")
    assert_config_error(["--job.config_file", path], path, "not valid TOML")


def test_a_config_file_naming_another_is_refused(tmp_path):
    path = write(tmp_path, '[job]\nconfig_file = "train_configs/llama3_8b.toml"\n')
    assert_config_error(
        ["--job.config_file", path],
        f"job.config_file (from config file {path})",
        "a config file cannot name another",
        "--job.config_file on the command",
    )


def test_toml_top_level_value(tmp_path):
    path = write(tmp_path, "steps = 5\n")
    assert_config_error(["--job.config_file", path], "'steps'", f"config file {path}", "[section]")


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_steps_below_one_cli(steps):
    # 0 steps would start every worker, build the model and train nothing
    assert_config_error(
        ["--training.steps", steps], "training.steps", steps, "command line", "must be >= 1"
    )


def test_negative_steps_toml(tmp_path):
    path = write(tmp_path, "[training]\nsteps = -3\n")
    assert_config_error(["--job.config_file", path], "training.steps", "-3", f"config file {path}")


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--training.seq_len", "0"], "training.seq_len"),
        (["--checkpoint.write_threads", "0"], "checkpoint.write_threads"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2"),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio"),
        (["--training.global_batch_size", "0"], "training.global_batch_size"),
        (
            ["--profiling.enable_profiling", "--profiling.profile_freq", "3"],
            "profiling.profiler_warmup",
        ),
    ],
)
def test_validation_errors_name_key(argv, key):
    assert_config_error(argv, key)


def test_validation_error_default_source():
    # the offending key comes from its default; the message says so
    assert_config_error(
        ["--profiling.enable_profiling", "--profiling.profile_freq", "2"],
        "profiling.profiler_warmup",
        "the default",
    )
    # without the trace, the warm-up window is not checked: memory snapshots every 2 steps
    parse_args(["--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"])


def test_value_missing():
    assert_config_error(["--training.steps"], "--training.steps", "needs a value")
    assert_config_error(
        ["--training.seq_len", "64", "--model.flavor"], "--model.flavor", "needs a value"
    )


def test_value_missing_before_next_flag():
    # the next flag is not swallowed as the value
    assert_config_error(
        ["--training.steps", "--training.seq_len", "64"], "--training.steps", "needs a value"
    )
    assert_config_error(
        ["--job.description", "--training.seq_len", "64"], "--job.description", "needs a value"
    )
    # a value that really starts with -- goes through the = form
    assert parse_args(["--job.description=--odd"]).job.description == "--odd"


# ----------------------------------------------------------------------------- help / dump


def test_help_lists_every_field_with_doc():
    text = help_text()
    lines = text.splitlines()
    for section, obj in sections(JobConfig()).items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(obj):
            flag = f"--{section}.{f.name}"
            matching = [ln for ln in lines if ln.split() and ln.split()[0] == flag]
            assert len(matching) == 1, flag
            doc = f.metadata["doc"]
            assert doc and doc in matching[0], flag


def test_help_lists_test_hooks_apart_after_the_real_options():
    lines = help_text().splitlines()
    heading = next(i for i, ln in enumerate(lines) if ln.startswith("TESTING HOOKS:"))
    flags = [(i, ln.split()[0]) for i, ln in enumerate(lines) if ln.startswith("  --")]
    hooks = [f for i, f in flags if i > heading]
    assert hooks and all(f.startswith("--debug.") for f in hooks)
    assert not any(f.startswith("--debug.") for i, f in flags if i < heading)
    assert "never set them for training" in lines[heading + 1]


def _non_default_config():
    cfg = JobConfig()
    cfg.job.description = 'quote " backslash \\ tab\tand unicode ünïcødé ✓'
    cfg.job.print_config = True
    cfg.model.flavor = "8B"
    cfg.training.dataset_path = "/data/shard-*.jsonl"
    cfg.training.dataset_shuffle = False
    cfg.training.steps = 12345
    cfg.training.max_norm = 0.5
    cfg.training.mixed_precision_param = "float32"
    cfg.optimizer.lr = 1.5e-4
    cfg.optimizer.eps = 1e-12
    cfg.optimizer.param_groups = [
        ParamGroup("norm|tok_embeddings", weight_decay=0.0),
        ParamGroup("experts", lr=1e-4),
    ]
    cfg.lr_scheduler.decay_ratio = 0.2
    cfg.lr_scheduler.decay_type = "sqrt"
    cfg.metrics.peak_flops = 989e12
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.activation_checkpoint.selective_ac_option = "op"
    return cfg


@pytest.mark.parametrize(
    "cfg", [JobConfig(), _non_default_config()], ids=["defaults", "non_defaults"]
)
def test_to_toml_round_trip(tmp_path, cfg):
    text = to_toml(cfg)
    tomllib.loads(text)  # valid TOML on its own
    path = write(tmp_path, text, "dump.toml")
    back = parse_args(["--job.config_file", path])
    # a printed config run as it is does not print itself again
    job = dataclasses.replace(cfg.job, config_file=path, print_config=False)
    assert back == dataclasses.replace(cfg, job=job)


def test_a_printed_config_runs_as_a_config_file(tmp_path):
    """--job.print_config's output fed back as CONFIG_FILE: the same run (it named its own
    config file and the test hooks before)."""
    from titan.config import with_config_file

    job = parse_args(with_config_file(["--job.print_config", "--training.steps", "7"]))
    text = to_toml(job)
    assert "[debug]" not in text and "\nconfig_file" not in text
    back = parse_args(["--job.config_file", write(tmp_path, text, "printed.toml")])
    assert back.training == job.training and back.model == job.model
    assert back.job.print_config is False


def test_to_toml_round_trip_control_characters(tmp_path):
    cfg = JobConfig()
    cfg.job.description = "two\nlines\r\nand a bell \x07 and del \x7f"
    text = to_toml(cfg)
    assert tomllib.loads(text)["job"]["description"] == cfg.job.description
    path = write(tmp_path, text, "dump.toml")
    assert parse_args(["--job.config_file", path]).job.description == cfg.job.description


def test_plain_python_entry_takes_help_and_run_train_sh_default_config(monkeypatch):
    """`python -m titan.trainer` prints --help like run_train.sh, and without --job.config_file
    starts from the file run_train.sh uses (CONFIG_FILE's, else the debug config), not the
    built-in defaults (seq 2048, lr 8e-4)."""
    from titan.config import with_config_file

    proc = subprocess.run(
        [sys.executable, "-m", "titan.trainer", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "--training.steps" in proc.stdout and "--job.config_file" in proc.stdout
    monkeypatch.delenv("CONFIG_FILE", raising=False)
    job = parse_args(with_config_file(["--training.steps", "3"]))
    assert job.job.config_file == "train_configs/debug_model.toml" and job.training.seq_len == 256
    monkeypatch.setenv("CONFIG_FILE", "train_configs/qwen3_debug.toml")
    assert with_config_file([])[:2] == ["--job.config_file", "train_configs/qwen3_debug.toml"]
    assert with_config_file(["--job.config_file=x.toml"]) == ["--job.config_file=x.toml"]
