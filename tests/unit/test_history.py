"""A checkpoint folder holds one history: a run that goes back (checkpoint.load_step) or
continues past a final HF export moves the newer steps, and the metrics logged after its
start, aside (named, logged, never deleted); keep_latest_k then counts only its own steps,
and a later plain resume continues the history the user chose."""

import json

import pytest

from tests.forked import rank_logs, run_trainer, tiny_run


def _run(tmp_path, name, dump, steps, *flags):
    argv = [*tiny_run(steps), "--checkpoint.enable", *flags]
    run_trainer(tmp_path / name, 1, argv, dump=dump)
    return rank_logs(tmp_path / name, 1)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _folders(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir())


def test_going_back_sets_the_newer_history_aside(tmp_path):
    dump = tmp_path / "dump"
    ck = dump / "checkpoint"
    _run(tmp_path, "first", dump, 6, "--checkpoint.interval", "3")
    assert _folders(ck) == ["step-3", "step-6"]
    first = _steps(dump / "metrics.jsonl")

    log = _run(
        tmp_path,
        "back",
        dump,
        5,
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.load_step",
        "3",
    )
    assert "resuming from step-3; the folder's newer step-6 (a checkpoint) kept in" in log
    assert _folders(ck / "history.1") == ["step-6"]
    assert (ck / "history.1" / "step-6" / ".complete").is_file()
    # keep_latest_k counted this run's own steps: 4 and 5 written, the older ones removed
    assert [p for p in _folders(ck) if p.startswith("step-")] == ["step-5"]
    # the abandoned history kept whole; the new one continues the first's steps 1-3
    assert _steps(dump / "metrics.1.jsonl") == first == [1, 2, 3, 4, 5, 6]
    assert _steps(dump / "metrics.jsonl") == [1, 2, 3, 4, 5]

    log = _run(tmp_path, "on", dump, 8, "--checkpoint.interval", "4")
    assert "resumed from" in log and "step-5 at step 5" in log
    assert _steps(dump / "metrics.jsonl") == list(range(1, 9))  # one history, no other's steps
    assert _folders(ck / "history.1") == ["step-6"]


def test_a_final_hf_export_is_kept_when_a_run_continues(tmp_path):
    dump = tmp_path / "dump"
    ck = dump / "checkpoint"
    flags = ["--checkpoint.interval", "2", "--checkpoint.last_save_in_hf"]
    _run(tmp_path, "first", dump, 4, *flags)
    exported = sorted(p.name for p in (ck / "step-4").iterdir())
    assert "model.safetensors" in exported and "config.json" in exported

    log = _run(tmp_path, "more", dump, 6, *flags)
    assert "step-4 is an HF export (model weights only), not a training state: kept" in log
    assert "resuming from step-2; the folder's newer step-4 (an HF export) kept in" in log
    # the export whole where the log says; this run's DCP step-4 beside it
    assert sorted(p.name for p in (ck / "history.1" / "step-4").iterdir()) == exported
    assert (ck / "step-4" / ".complete").is_file() and not (ck / "step-4" / "config.json").exists()
    assert _steps(dump / "metrics.jsonl") == list(range(1, 7))
    assert _steps(dump / "metrics.1.jsonl") == [1, 2, 3, 4]


def test_going_back_to_overwrite_a_step_keeps_the_old_one(tmp_path):
    dump = tmp_path / "dump"
    ck = dump / "checkpoint"
    _run(tmp_path, "first", dump, 6, "--checkpoint.interval", "3")
    old = (ck / "step-6" / ".complete").read_text()
    flags = ["--checkpoint.interval", "3", "--checkpoint.load_step", "3", "--optimizer.lr", "1e-3"]
    _run(tmp_path, "again", dump, 6, *flags)
    assert (ck / "history.1" / "step-6" / ".complete").read_text() == old
    assert _folders(ck) == ["history.1", "step-3", "step-6"]


def test_a_resume_with_another_tokenizer_names_the_tokenizer(tmp_path):
    """The chat tokenizer has 2051 tokens to the bundled one's 2048: the vocabulary's size
    differs too, and the refusal names the tokenizer, not the model."""

    dump = tmp_path / "dump"
    _run(tmp_path, "first", dump, 2, "--checkpoint.interval", "2")
    chat = ["--model.tokenizer_path", "assets/tokenizer_chat/tokenizer.json"]
    with pytest.raises(pytest.fail.Exception) as e:
        _run(tmp_path, "other", dump, 4, "--checkpoint.interval", "2", *chat)
    message = str(e.value)
    assert "its model was trained with the tokenizer" in message
    assert "this run reads assets/tokenizer_chat" in message
    assert "vocab_size" not in message


@pytest.mark.needs("transformers")
def test_an_export_keeps_the_source_models_context_and_fields(tmp_path):
    """A transformers Llama with max_position_embeddings 512, trained from its folder at
    seq_len 32: the export says 512 (it said the training length before) and keeps the
    source's fields titan does not write; a fine-tune's export averages with its base."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.01,
        pad_token_id=0,
    )
    source = tmp_path / "source"
    transformers.LlamaForCausalLM(config).save_pretrained(str(source))
    dump = tmp_path / "dump"
    flags = ["--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf"]
    _run(
        tmp_path,
        "tune",
        dump,
        2,
        *flags,
        "--model.flavor",
        "from_hf",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_in_hf",
    )
    exported = json.loads((dump / "checkpoint" / "step-2" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 512
    assert (exported["initializer_range"], exported["pad_token_id"]) == (0.01, 0)
    assert exported["torch_dtype"] == "float32" and "dtype" not in exported

    from titan.tools.average import main as average

    average(
        [
            "--checkpoints",
            str(source),
            str(dump / "checkpoint" / "step-2"),
            "--out",
            str(tmp_path / "avg"),
        ]
    )
    assert (tmp_path / "avg" / "config.json").is_file()
