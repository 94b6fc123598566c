"""The edges a new user met (issue 57), each through what the user types: nothing silently
wrong or lost, one line at every failure, the options a run ignores named, names that keep
working. Launcher cases run its main in this process (run_train.sh only execs it)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import TOKENIZER_PATH
from titan.components.checkpoint.folders import COMPLETE_MARKER
from titan.components.data.dataset import DataError, check_messages, local_files
from titan.components.observability.jsonl_writer import JsonlWriter
from titan.components.observability.writers import WriterContext
from titan.config import ConfigError, extensions, parse_args
from titan.launcher import launch
from titan.plan.run_plan import plan_run
from titan.runtime.paths import REPO_ROOT

CONFIG = ("--job.config_file", "train_configs/debug_model.toml")


def launch_main(monkeypatch, capsys, tmp_path, *overrides, dry_run="1"):
    """(exit code, stdout, stderr) of the launcher's main on these overrides, with DRY_RUN."""
    from tests.unit.test_content_check import run_launcher

    monkeypatch.setenv("DRY_RUN", dry_run)
    return run_launcher(monkeypatch, capsys, tmp_path / "dump", overrides, nproc=1)


# ----------------------------------------------------------------------------- names that moved


@pytest.mark.parametrize(
    "old, new",
    [("titan.train", "titan.trainer"), ("titan.generate", "titan.tools.generate")],
)
def test_old_module_names_run_the_new_ones_and_say_so_once(old, new):
    proc = subprocess.run(
        [sys.executable, "-m", old, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RANK"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = f"titan: python -m {old} is now python -m {new} (the old name keeps working)"
    assert proc.stderr.count(said) == 1, proc.stderr
    # the new module's own help ran: the trainer's lists config keys, generate's its flags
    assert ("--training.steps" if old == "titan.train" else "--max-new-tokens") in proc.stdout


def test_dry_run_takes_the_usual_spellings_and_refuses_others(monkeypatch, capsys, tmp_path):
    code, out, _ = launch_main(monkeypatch, capsys, tmp_path, dry_run="true")
    assert code == 0 and out.startswith("torchrun ")
    # off: it goes on to torchrun, stopped here at the call
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: sys.exit(7))
    assert launch_main(monkeypatch, capsys, tmp_path, dry_run="false")[0] == 7
    code, _, err = launch_main(monkeypatch, capsys, tmp_path, dry_run="maybe")
    assert code == 2 and "DRY_RUN='maybe': use DRY_RUN=1" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- ignored options


def test_every_ignored_option_is_named_in_one_warning(monkeypatch, capsys, tmp_path):
    code, _, err = launch_main(
        monkeypatch,
        capsys,
        tmp_path,
        "--deepseek_v3.mtp_depth",
        "2",
        "--parallelism.context_parallel_type",
        "alltoall",
        "--parallelism.context_parallel_load_balance",
        "false",
        "--validation.freq",
        "7",
        "--lora.alpha",
        "8",
    )
    assert code == 0
    warnings = [line for line in err.splitlines() if "ignores" in line]
    assert warnings == [
        "titan: warning: this run ignores deepseek_v3.mtp_depth (this run trains llama3); "
        "lora.alpha (the lora converter is off); parallelism.context_parallel_load_balance, "
        "parallelism.context_parallel_type (parallelism.context_parallel_degree is 1); "
        "validation.freq (validation.enable is false)"
    ], err
    # what a run uses, or sets to the default, is not named; nor a config file's settings of
    # what it switches off (debug_model.toml's [validation], a template)
    job = parse_args(["--validation.enable", "--validation.freq", "7", "--lora.alpha", "16"])
    assert extensions.ignored_warning(job) is None
    assert extensions.ignored_warning(parse_args(list(CONFIG))) is None


def test_a_param_group_that_takes_no_parameter_is_refused():
    job = parse_args(["--optimizer.param_groups", '[{params = "nrom", weight_decay = 0.0}]'])
    with pytest.raises(ConfigError, match="'nrom' matches no trainable parameter"):
        plan_run(job)
    shadowed = '[{params = "norm"}, {params = "attention_norm", lr = 0.1}]'
    with pytest.raises(ConfigError, match="an earlier group's regex takes all it matches"):
        plan_run(parse_args(["--optimizer.param_groups", shadowed]))
    plan_run(parse_args(["--optimizer.param_groups", '[{params = "norm", weight_decay = 0.0}]']))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["--lora.rank", "512"], "lora.rank 512 is more than layers.0.attention.w"),
        (["--lora.rank", "8", "--lora.target_modules", "wq("], "'wq(' is not a regex"),
    ],
    ids=["rank", "regex"],
)
def test_lora_settings_that_cannot_work_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("[", r"\[")):
        plan_run(parse_args(overrides))


def test_cp_without_load_balancing_needs_seq_len_divisible_by_cp_only():
    common = ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "258"]
    with pytest.raises(ConfigError, match="2 x context_parallel_degree = 4 .load balancing"):
        plan_run(parse_args(common), world_size=2)
    plan_run(parse_args([*common, "--parallelism.context_parallel_load_balance", "false"]), 2)


def test_multi_token_prediction_on_chat_data_is_refused():
    job = parse_args(
        [
            "--job.config_file",
            "train_configs/deepseek_v3_debug.toml",
            "--training.dataset_format",
            "chat",
            "--training.dataset",
            "chat",
            "--model.attn_mask_type",
            "block_causal",
            "--model.tokenizer_path",
            "assets/tokenizer_chat",
        ]
    )
    with pytest.raises(ConfigError, match="mtp_depth 1: a prediction depth reads the next"):
        plan_run(job)


# ----------------------------------------------------------------------------- plugins


@pytest.mark.parametrize(
    "source, says",
    [
        ("x = 1\nraise RuntimeError('no GPU here')\n", "line 2: RuntimeError: no GPU here"),
        ("def f(:\n", "line 1: SyntaxError"),
        ("import no_such_package_anywhere\n", "ModuleNotFoundError"),
        (
            "from titan.components.observability.writers import WriterSpec, register_writer\n"
            "register_writer(WriterSpec('jsonl', build='x:y', enabled=lambda c, o: True))\n",
            "a metrics writer named 'jsonl' is already registered; register it under another",
        ),
    ],
    ids=["raises", "syntax", "import", "taken_name"],
)
def test_a_plugin_that_fails_to_import_is_one_line(tmp_path, source, says):
    plugin = tmp_path / "bad_plugin.py"
    plugin.write_text(source)
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.custom_import", str(plugin)])
    msg = str(e.value)
    assert msg.startswith(f"job.custom_import '{plugin}': importing it failed at ")
    assert says in msg and msg.endswith("; fix the plugin") and "\n" not in msg, msg


# ----------------------------------------------------------------------------- data


def test_odd_dataset_folders_are_named(tmp_path):
    folder = tmp_path / "data"
    (folder / "part.jsonl").mkdir(parents=True)  # a folder named like a file
    (folder / "part.jsonl" / "a.jsonl").write_text('{"text": "a"}\n')
    assert local_files("x", str(folder)) == [folder / "part.jsonl" / "a.jsonl"]
    (folder / "gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(DataError, match="gone.jsonl is a link to .*nowhere.jsonl, which does"):
        local_files("x", str(folder))
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    with pytest.raises(DataError, match="is neither a file nor a folder .a named pipe"):
        local_files("x", str(pipe))


def test_openai_style_content_parts_are_text():
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Who "}, {"type": "text", "text": "?"}],
        },
        {"role": "assistant", "content": "Moses."},
    ]
    check_messages(messages, "f: record 1", "messages")
    assert messages[0]["content"] == "Who ?"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
    with pytest.raises(DataError, match="message 1 .user. has content parts of type image_url"):
        check_messages(image, "f: record 1", "messages")


def test_chat_records_read_as_text_say_so(monkeypatch, capsys, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    code, _, err = launch_main(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(chat))
    assert code == 2 and 'set training.dataset_format = "chat"' in err, err


def test_resuming_onto_other_data_starts_it_at_its_beginning(tokenizer, caplog):
    from tests.unit.test_data import loader, xy

    def first_batches(data, n=2):
        it = iter(data)
        return [xy(next(it))[0] for _ in range(n)]

    kjv = loader(tokenizer, 4, 4)
    it = iter(kjv)
    for _ in range(3):
        next(it)
    state = kjv.state_dict()
    assert state["sources"] == ["kjv"] and state["source_windows"][0] > 0
    fresh = first_batches(loader(tokenizer, 4, 4, dataset="kjv_valid"))
    moved = loader(tokenizer, 4, 4, dataset="kjv_valid")
    with caplog.at_level(logging.WARNING):
        moved.load_state_dict(state)
    assert "the data is not what the checkpoint trained on (kjv then, kjv_valid now)" in caplog.text
    assert moved.state_dict()["global_batches"] == 3  # the step count goes on
    assert all((a == b).all() for a, b in zip(first_batches(moved), fresh))


# ----------------------------------------------------------------------------- history


def writer(folder, resume_step=None) -> JsonlWriter:
    return JsonlWriter(None, None, WriterContext(str(folder), resume_step, {}))


def test_a_new_run_keeps_the_history_it_finds(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (tmp_path / "validation.jsonl").write_text('{"step": 1, "val_loss": 9.5}\n')
    with caplog.at_level(logging.WARNING):
        writer(tmp_path).close()
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert (tmp_path / "validation.1.jsonl").read_text() == '{"step": 1, "val_loss": 9.5}\n'
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert "held an earlier run's history: kept as metrics.1.jsonl" in caplog.text
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    writer(tmp_path).close()  # the next one goes beside it
    assert (tmp_path / "metrics.2.jsonl").read_text() == '{"step": 1, "loss": 8.0}\n'


def test_a_torn_last_line_does_not_stop_a_resume(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n{"step": 3, "loss": 7.0}\n'
        '{"step": 4, "lo'
    )
    with caplog.at_level(logging.WARNING):
        w = writer(tmp_path, resume_step=3)
    w.scalars(4, {"train/loss": float("nan"), "train/grad_norm": float("inf")})
    w.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    records = [json.loads(line, parse_constant=pytest.fail) for line in text.splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1] == {"step": 4, "loss": None, "grad_norm": None}  # strict JSON
    assert "1 line(s) that are not a step's record" in caplog.text


# ----------------------------------------------------------------------------- resume checks


@pytest.fixture
def trained_folder(tmp_path):
    """A dump folder whose step-2 checkpoint records AdamW and the bundled tokenizer."""
    from tests.unit.test_checkpoint_integrity import save_model
    from titan.components.checkpoint.trained_with import trained_with
    from titan.components.data.tokenizer import Tokenizer

    step = save_model(tmp_path / "checkpoint" / "step-2")
    marker = json.loads((step / COMPLETE_MARKER).read_text())
    marker["model_only"] = False
    marker["trained_with"] = trained_with("AdamW", Tokenizer(TOKENIZER_PATH))
    (step / COMPLETE_MARKER).write_text(json.dumps(marker))
    return tmp_path


def launcher_check(*argv):
    from titan.assembly.checkpoint_check import check_checkpoints

    job = parse_args(list(argv))
    check_checkpoints(job, plan_run(job, world_size=1))


def test_a_resume_onto_another_optimizer_or_tokenizer_is_refused(trained_folder, tmp_path):
    resume = ["--checkpoint.enable", "--job.dump_folder", str(trained_folder)]
    launcher_check(*resume)  # the same: fine
    with pytest.raises(ConfigError) as e:
        launcher_check(*resume, "--optimizer.name", "Muon")
    assert "its optimizer state is AdamW's and this run's optimizer is Muon" in str(e.value)
    assert "--checkpoint.exclude_from_loading optimizer" in str(e.value)
    launcher_check(
        *resume, "--optimizer.name", "Muon", "--checkpoint.exclude_from_loading", "optimizer"
    )
    # the same vocabulary in another file: other ids for the same text, for all titan knows
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    vocab = json.loads((REPO_ROOT / "assets/tokenizer/tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(vocab, indent=1))
    with pytest.raises(ConfigError) as e:
        launcher_check(*resume, "--model.tokenizer_path", str(other))
    assert f"assets/tokenizer and this run reads {other}, which maps text to other ids" in str(
        e.value
    )


# ----------------------------------------------------------------------------- planner

SUGGEST = ["--suggest", "--device-memory", "80GiB"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            [*SUGGEST, "--efficiency", "0"],
            "--efficiency 0.0: must be in (0, 1]",
        ),
        (
            [*SUGGEST, "--peak-tflops", "0"],
            "--peak-tflops 0.0: must be > 0",
        ),
        ([*SUGGEST, "--top", "0"], "--top 0: must be >= 1"),
        (
            [*SUGGEST, "--margin", "2"],
            "--margin 2.0: must be in [0, 1)",
        ),
        (["--inter-node-gbps", "-1"], "--inter-node-gbps -1.0: must be > 0"),
    ],
)
def test_planner_refuses_meaningless_hardware(argv, says, capsys):
    from titan.planner.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_planner_says_when_the_plan_does_not_fit(capsys):
    from titan.planner.cli import main

    assert main(["--device-memory", "1KiB"]) == 1
    assert "does NOT fit: the fullest rank needs" in capsys.readouterr().out
    assert main(["--device-memory", "80GiB"]) == 0
    assert "fits, headroom" in capsys.readouterr().out


# ----------------------------------------------------------------------------- generate


def test_generate_refuses_system_without_chat_and_takes_underscored_flags(capsys):
    from titan.tools.generate import main

    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", "x", "--prompt", "a", "--system", "be brief"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--system is the system turn of a chat prompt: add --chat" in err
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", "x", "--prompt", "a", "--max_new_tokens", "0"])
    assert "--max-new-tokens 0: must be >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- cannot learn


def mask_every_label(tokenizer):
    """A dataset's fields that mask every label (as data with no counted token would)."""
    import torch

    return lambda sample: {"labels": torch.full_like(sample["labels"], -100)}


def test_a_step_with_no_counted_label_stops_the_run(tmp_path):
    from tests.forked import run_trainer, tiny_run
    from titan.components.data.dataset import DatasetSpec, register_dataset, unregister_dataset

    register_dataset(
        DatasetSpec(
            "all_masked",
            "assets/corpus/kjv_valid.jsonl",
            fields="tests.unit.test_user_edges:mask_every_label",
        )
    )
    try:
        with pytest.raises(pytest.fail.Exception) as e:
            run_trainer(tmp_path, 1, [*tiny_run(2), "--training.dataset", "all_masked"])
    finally:
        unregister_dataset("all_masked")
    assert "DataError: step 1: no label of the global batch is one the loss counts" in str(e.value)
    assert not (tmp_path / "dump" / "metrics.jsonl").read_text()  # no step was taken


def test_a_run_with_no_learning_rate_trains_nothing_and_says_so(tmp_path):
    """optimizer.lr = 0 (an evaluation-only run, a data-pipeline check) runs, warned once
    (rank 0's console), and its weights do not move."""
    from tests.forked import rank_logs, run_trainer, tiny_run
    from titan.components.checkpoint.folders import load_dcp_model_state

    ck = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
    records = run_trainer(tmp_path, 1, [*tiny_run(3), *ck, "--optimizer.lr", "0"])
    log = rank_logs(tmp_path, 1)
    assert log.count("optimizer.lr = 0 and no param group's lr is above it") == 1
    assert [r["lr"] for r in records] == [0.0, 0.0, 0.0]
    first, last = (
        load_dcp_model_state(tmp_path / "dump" / "checkpoint" / s) for s in ("step-1", "step-3")
    )
    assert first.keys() == last.keys() and all(first[k].equal(last[k]) for k in first)


def test_generate_decodes_with_the_tokenizer_the_checkpoint_trained_with(tmp_path):
    from titan.tools.generate import GenerateError, trained_tokenizer

    step = tmp_path / "step-2"
    step.mkdir()
    chat = str(REPO_ROOT / "assets" / "tokenizer_chat")
    (step / COMPLETE_MARKER).write_text(
        json.dumps({"step": 2, "trained_with": {"tokenizer": {"path": chat, "fingerprint": "x"}}})
    )
    assert trained_tokenizer(step, parse_args([])) == chat
    named = parse_args(["--model.tokenizer_path", "assets/tokenizer"])
    assert trained_tokenizer(step, named) == "assets/tokenizer"  # a named one is used
    (step / COMPLETE_MARKER).write_text(
        json.dumps({"step": 2, "trained_with": {"tokenizer": {"path": "/gone/tok"}}})
    )
    with pytest.raises(GenerateError, match="trained with the tokenizer /gone/tok, which is not"):
        trained_tokenizer(step, parse_args([]))


def test_generate_reads_a_checkpoint_with_its_family_options(tmp_path, capsys):
    """A DeepSeek-V3 save with a multi-token-prediction depth (the bundled config's) is read
    with the depth it records; a resume with another depth names the option to set."""
    import torch

    from titan.components.checkpoint.folders import save_dcp_model_state
    from titan.components.checkpoint.identity import model_identity
    from titan.models.spec import get_train_spec
    from titan.tools.generate import main

    spec = get_train_spec("deepseek_v3")
    args = spec.flavors["debugmodel"].with_updates(vocab_size=2048, max_seq_len=64, mtp_depth=1)
    ident = model_identity(spec, "debugmodel", args)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) * 0.02 for n, s in ident.shapes.items()}
    step = save_dcp_model_state(state, tmp_path / "checkpoint" / "step-1", model=ident.record())
    main(["--checkpoint", str(step), "--prompt", "In the", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("In the")  # one prompt: streamed
    other = args.with_updates(mtp_depth=2)
    why = model_identity(spec, "debugmodel", other).problem(step)
    assert "deepseek_v3.mtp_depth 1 (checkpoint) vs 2 (this run)" in why
    assert why.endswith("set --deepseek_v3.mtp_depth 1 to load it")
    # as the base of a run without the depths: loaded without them (a resume is refused)
    plain = model_identity(spec, "debugmodel", args.with_updates(mtp_depth=0))
    assert plain.problem(step, base=True) is None
    assert "set --deepseek_v3.mtp_depth 1" in plain.problem(step)


def test_an_unreachable_hub_is_one_line_at_once(monkeypatch):
    import time

    import datasets

    from titan.components.data.dataset import open_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(DataError, match="the HF hub is not reachable: 127.0.0.1 cannot be"):
        open_hub("allenai/c4:en")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_the_first_loss_is_near_uniform_tied_or_not(flavor, tokenizer):
    """At init every flavor predicts close to uniformly: a tied matrix at the output's scale
    made the first logits pick the input token itself (loss 13.5 against ln 2048 = 7.6)."""
    import math

    import torch
    import torch.nn.functional as F

    from titan.models.spec import get_train_spec

    spec = get_train_spec("llama3")
    args = spec.flavors[flavor].with_updates(vocab_size=2048, max_seq_len=64)
    model = spec.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(0, buffer_device=torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("In the beginning God created the heaven and the earth.")])
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    assert abs(loss - math.log(2048)) < 1.0, loss


def test_a_base_with_prediction_depths_starts_a_run_without_them(tmp_path):
    """Through the trainer: a DeepSeek-V3 run with mtp_depth 0 starts from a save with one
    depth, the depth's weights left unread; the first loss is the base's, not a fresh init's."""
    from tests.forked import run_trainer, tiny_run

    deepseek = ["--job.config_file", "train_configs/deepseek_v3_debug.toml", *tiny_run(1)]
    run_trainer(
        tmp_path / "a", 1, [*deepseek, "--checkpoint.enable", "--deepseek_v3.mtp_depth", "1"]
    )
    base = tmp_path / "a" / "dump" / "checkpoint" / "step-1"
    flags = [*deepseek, "--deepseek_v3.mtp_depth", "0", "--training.seed", "7"]
    fresh = run_trainer(tmp_path / "b", 1, flags)
    loaded = run_trainer(tmp_path / "c", 1, [*flags, "--checkpoint.initial_load_path", str(base)])
    assert loaded[0]["loss"] != fresh[0]["loss"]
    assert (
        "the blocks beyond this run's are not loaded" in (tmp_path / "c" / "rank0.log").read_text()
    )
