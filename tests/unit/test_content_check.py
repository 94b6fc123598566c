"""Bad files are refused by the launcher, before torchrun starts a worker: exit code 2 and
one line naming the file and the fix (titan/launcher/content_check.py). Each case runs the
launcher's main in this process (run_train.sh only execs it); none gets as far as torchrun."""

import json
import sys

import pytest

from tests.conftest import TOKENIZER_PATH
from titan.components.data.content_check import check_content
from titan.components.data.token_shards import META, ShardWriter
from titan.components.data.tokenizer import Tokenizer
from titan.config import ConfigError, parse_args
from titan.launcher import launch
from titan.plan.run_plan import plan_run


def run_launcher(monkeypatch, capsys, dump, overrides, nproc: int = 2) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the launcher's main on these trainer overrides."""
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "titan.launcher.launch",
            "--standalone",
            "--nnodes=1",
            f"--nproc_per_node={nproc}",
            "--",
            *overrides,
            "--job.dump_folder",
            str(dump),
        ],
    )
    with pytest.raises(SystemExit) as exit_:
        launch.main()
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def launcher_refuses(monkeypatch, capsys, tmp_path, *overrides) -> str:
    """The launcher's one line for these trainer overrides; asserts exit 2, nothing written."""
    dump = tmp_path / "never"
    code, _, err = run_launcher(monkeypatch, capsys, dump, overrides)
    assert code == 2, err
    assert err.startswith("titan: config error: ") and err.count("\n") == 1, err
    assert not dump.exists()
    return err


@pytest.mark.parametrize(
    "args,key",
    [
        (["--training.dataset_path", "no_such_dir/missing.jsonl"], "training.dataset_path"),
        (
            [
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "x2",
            ],
            "activation_checkpoint.selective_ac_option",
        ),
    ],
    ids=["missing_dataset", "selective_ac_option"],
)
def test_worker_time_errors_are_refused_before_launch(monkeypatch, capsys, tmp_path, args, key):
    """Mistakes once found inside the workers (a traceback per rank, exit 1)."""
    assert key in launcher_refuses(monkeypatch, capsys, tmp_path, *args)


@pytest.mark.parametrize(
    "content,says",
    [
        (b"", "is empty; fill it or remove it"),
        (b'{"text": "fine"}\nIn the beginning\n', "line 2 is not JSON"),
        (
            b'{"body": "In the beginning"}\n',
            "line 1 has no 'text' field (fields: ['body']); set training.dataset_text_field",
        ),
        (b'["In the beginning"]\n', "line 1 is a JSON list, not an object"),
    ],
    ids=["empty", "not_json", "no_text_field", "not_an_object"],
)
def test_bad_jsonl_is_refused_before_launch(monkeypatch, capsys, tmp_path, content, says):
    bad = tmp_path / "corpus" / "b.jsonl"
    bad.parent.mkdir()
    (bad.parent / "a.jsonl").write_text('{"text": "a good file first"}\n')
    bad.write_bytes(content)
    err = launcher_refuses(
        monkeypatch, capsys, tmp_path, "--training.dataset_path", str(bad.parent)
    )
    assert f"training.dataset: {bad} " in err and says in err


CHAT = [
    "--training.dataset_format",
    "chat",
    "--model.tokenizer_path",
    "assets/tokenizer_chat",
    "--model.attn_mask_type",
    "block_causal",
]


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"text": "a document"}', "line 2 has no 'messages' field"),
        ('{"messages": [{"role": "user"}]}', "line 2: message 1 (user) has no text content"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant message"),
    ],
    ids=["text_not_chat", "no_content", "no_assistant"],
)
def test_bad_chat_rows_are_refused_before_launch(monkeypatch, capsys, tmp_path, line, says):
    good = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    )
    bad = tmp_path / "chat.jsonl"
    bad.write_text(good + "\n" + line + "\n")
    err = launcher_refuses(
        monkeypatch, capsys, tmp_path, *CHAT, "--training.dataset_path", str(bad)
    )
    assert f"training.dataset: {bad} " in err and says in err, err


def test_parquet_footer_is_checked(monkeypatch, capsys, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["In the beginning"]}), table)
    err = launcher_refuses(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(table))
    assert f"{table} has no column 'text' (columns: ['body'])" in err
    table.write_bytes(table.read_bytes()[:-8])  # a copy cut short
    err = launcher_refuses(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(table))
    assert f"{table} is not a readable parquet file" in err and "write it again" in err


def test_validation_files_are_checked_too(monkeypatch, capsys, tmp_path):
    empty = tmp_path / "valid.jsonl"
    empty.touch()
    err = launcher_refuses(
        monkeypatch,
        capsys,
        tmp_path,
        "--validation.enable",
        "--validation.dataset_path",
        str(empty),
    )
    assert f"validation.dataset: {empty} is empty" in err


def _shards(folder, tokenizer):
    writer = ShardWriter(folder, tokenizer, shard_tokens=8)
    writer.add([[1, 5, 6, 7, 2]] * 4)
    return writer.close()


def test_truncated_token_shard_is_refused(monkeypatch, capsys, tmp_path):
    folder = _shards(tmp_path / "shards", Tokenizer(str(TOKENIZER_PATH)))
    last = sorted(folder.glob("*.bin"))[-1]
    last.write_bytes(last.read_bytes()[:-2])
    err = launcher_refuses(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(folder))
    assert f"token shard {last} is 18 bytes, but {folder / META} says 20" in err
    assert "scripts/pretokenize.py" in err


def test_a_stream_of_token_shards_is_refused_when_planned(tmp_path):
    """Token shards are read indexed: the data's plan check says so (the loader checks it no
    more), naming the section's key."""
    folder = _shards(tmp_path / "shards", Tokenizer(str(TOKENIZER_PATH)))
    job = parse_args(["--training.dataset_path", str(folder), "--training.dataset_streaming"])
    with pytest.raises(ConfigError, match=r"training.dataset_streaming with .*holds token shards"):
        plan_run(job, world_size=1)


def test_shards_of_another_tokenizer_are_refused(monkeypatch, capsys, tmp_path):
    other = tmp_path / "tok"
    other.mkdir()
    data = json.loads(TOKENIZER_PATH.read_text())
    data["model"]["vocab"]["zzz_extra"] = len(data["model"]["vocab"])  # another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(data))
    folder = _shards(tmp_path / "shards", Tokenizer(str(other)))
    err = launcher_refuses(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(folder))
    assert f"token shards {folder} were written by the tokenizer {other / 'tokenizer.json'}" in err
    assert "Set model.tokenizer_path to the tokenizer that wrote them" in err


def test_hf_folder_missing_or_truncated_shard_is_refused(monkeypatch, capsys, tmp_path):
    import torch
    from safetensors.torch import save_file

    from titan.components.checkpoint.hf_io import HF_INDEX_FILE
    from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from titan.models.spec import get_train_spec

    args = get_train_spec("llama3").flavors["debugmodel"].with_updates(vocab_size=2048)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(Llama3StateDictAdapter(args).hf_config()))
    names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    (hf / HF_INDEX_FILE).write_text(json.dumps({"weight_map": {"a": names[0], "b": names[1]}}))
    save_file({"a": torch.zeros(64)}, str(hf / names[0]))
    load = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"]

    err = launcher_refuses(monkeypatch, capsys, tmp_path, *load)
    assert (
        f"checkpoint.initial_load_path: {HF_INDEX_FILE} in '{hf}' names missing shards "
        f"['{names[1]}']; download or copy them again" in err
    )
    save_file({"b": torch.zeros(64)}, str(hf / names[1]))
    whole = (hf / names[1]).stat().st_size
    (hf / names[1]).write_bytes((hf / names[1]).read_bytes()[:-10])
    err = launcher_refuses(monkeypatch, capsys, tmp_path, *load)
    assert f"{hf / names[1]} is truncated ({whole - 10} of {whole} bytes)" in err


def test_good_files_pass(tmp_path):
    """The checks read heads, not everything: a jsonl whose bad record comes after the lines
    checked passes here (the workers report it, test_final_error.py)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "verse {i}"}}\n' for i in range(20)) + "garbage\n")
    job = parse_args(["--training.dataset_path", str(corpus), "--validation.enable"])
    check_content(job, plan_run(job, world_size=1).tokenizer)


def test_the_trainers_own_entry_refuses_what_the_launcher_does(monkeypatch, capsys, tmp_path):
    """`python -m titan.trainer` (no launcher) makes the same plan checks of what the run
    reads, on rank 0, with the same line; a worker the launcher started skips them (made
    once per launch), as does any rank but 0."""
    from titan.runtime.inputs_checked import INPUTS_CHECKED
    from titan.trainer import train

    corpus = tmp_path / "bad.jsonl"
    corpus.write_text("not json\n")
    args = ["--training.dataset_path", str(corpus)]
    launched = launcher_refuses(monkeypatch, capsys, tmp_path, *args)
    dump = tmp_path / "own"
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.main([*args, "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and launched in err, (launched, err)
    assert not dump.exists()
    job = parse_args(args)
    plan_run(job, world_size=1)  # a plan only weighed reads no file
    for env, value in ((INPUTS_CHECKED, "1"), ("RANK", "1")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            plan_run(job, world_size=1, starting=True)
    with pytest.raises(ConfigError, match="bad.jsonl"):
        plan_run(job, world_size=1, starting=True)
