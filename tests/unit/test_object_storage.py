"""Checkpoints on object storage (checkpoint.folder = "s3://bucket/prefix"), against a real S3
server on 127.0.0.1 (moto's server mode): a run saves into the bucket and resumes from it bit
for bit, also onto another layout; retention removes whole prefixes; a torn upload (no
marker) and a corrupted object are skipped for the previous step; what cannot work is one
line before any rank starts. tests/integration/test_object_storage.py kills a rank during an
upload under run_train.sh."""

import json
import sys

import pytest
import torch

from tests.forked import rank_logs, run_trainer, tiny_run
from tests.s3_server import forget_clients, keys, s3_server
from titan.config import ConfigError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
SERVED = pytest.mark.needs("moto", "s3fs", "upath")  # the tests that talk to the server

BUCKET = "titan-ckpt"
STEPS = 6
EVERY_2 = ["--checkpoint.enable", "--checkpoint.interval", "2"]


def folder(prefix: str, keep: int = 0) -> list[str]:
    return [
        *EVERY_2,
        "--checkpoint.folder",
        f"s3://{BUCKET}/{prefix}",
        "--checkpoint.keep_latest_k",
        str(keep),
    ]


@pytest.fixture(scope="module")
def s3():
    with s3_server(BUCKET) as client:
        yield client


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """6 steps on a local disk, uninterrupted, saved at the end: what every stored run must
    reproduce."""
    tmp = tmp_path_factory.mktemp("straight")
    at_end = ["--checkpoint.enable", "--checkpoint.interval", "100"]
    losses = [r["loss"] for r in run_trainer(tmp, 1, [*tiny_run(STEPS), *at_end])]
    return losses, tmp / "dump" / "checkpoint" / f"step-{STEPS}"


@pytest.fixture(scope="module")
def straight(local_run):
    return local_run[0]


def generated(checkpoint: str) -> list[list[int]]:
    """titan.tools.generate's greedy tokens from `checkpoint` (a folder or URL)."""
    from titan.models.common.generation import generate
    from titan.tools.generate import load_model, open_checkpoint

    job, path, spec, _ = open_checkpoint(checkpoint, [])
    model, _ = load_model(path, job, spec, 64, torch.device("cpu"))
    return generate(model, [[1, 5, 9, 200]], max_new_tokens=8, eos_id=None)


def steps_in(client, prefix: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in keys(client, BUCKET, f"{prefix}/"):
        step, name = key[len(prefix) + 1 :].split("/", 1)
        out.setdefault(step, []).append(name)
    return out


def stop_after(client, prefix: str, step: int) -> None:
    """The bucket as if the job had stopped after `step`'s save: the later steps' objects
    deleted."""
    for key in keys(client, BUCKET, f"{prefix}/"):
        if int(key[len(prefix) + 1 :].split("/", 1)[0].removeprefix("step-")) > step:
            client.delete_object(Bucket=BUCKET, Key=key)


@pytest.fixture(scope="module")
def stored(s3, tmp_path_factory):
    """6 steps saved every 2 into the bucket's `run/` (keep_latest_k 2), and a copy of its
    step-6 under `tools/` for the readers' test: (the run's losses, its dump)."""
    tmp = tmp_path_factory.mktemp("stored")
    rows = run_trainer(tmp, 1, [*tiny_run(STEPS), *folder("run", keep=2)])
    for key in keys(s3, BUCKET, "run/step-6/"):
        copy = {"Bucket": BUCKET, "Key": key}
        s3.copy_object(Bucket=BUCKET, Key="tools/" + key.removeprefix("run/"), CopySource=copy)
    return [r["loss"] for r in rows]


@SERVED
def test_a_run_saves_into_the_bucket_and_resumes_bitwise(s3, straight, stored, tmp_path):
    assert stored == straight
    steps = steps_in(s3, "run")
    # keep_latest_k = 2: step-2's prefix removed whole once step-6 was complete
    assert sorted(steps) == ["step-4", "step-6"]
    for names in steps.values():
        # the shards, DCP's metadata and the marker, and no checksum sidecar left behind
        assert ".complete" in names and ".metadata" in names
        assert any(n.endswith(".distcp") for n in names)
        assert not any(n.endswith(".checksums.json") for n in names)
    marker = json.loads(s3.get_object(Bucket=BUCKET, Key="run/step-4/.complete")["Body"].read())
    sizes = {
        k.rsplit("/", 1)[1]: s3.head_object(Bucket=BUCKET, Key=k)["ContentLength"]
        for k in keys(s3, BUCKET, "run/step-4/")
    }
    assert {n: size for n, (_, size) in marker["files"].items()} == {
        n: size for n, size in sizes.items() if n != ".complete"
    }
    stop_after(s3, "run", 4)
    second = run_trainer(tmp_path, 1, [*tiny_run(STEPS), *folder("run", keep=2)])
    assert "resumed from s3://titan-ckpt/run/step-4 at step 4" in rank_logs(tmp_path, 1)
    assert [r["loss"] for r in second] == straight[4:]


@SERVED
def test_the_tools_read_a_step_in_the_bucket_as_on_disk(stored, local_run, tmp_path):
    """The same step-6 in the bucket and on disk: generation (and evaluation, through the same
    opening) gives the same tokens, a run started from it the same losses,
    scripts/convert_to_hf.py the same HF weights, titan.tools.average of the two the
    weights."""
    from safetensors.torch import load_file

    from tests.unit.test_qwen3 import _script
    from titan.components.checkpoint.folders import load_dcp_model_state
    from titan.tools.average import main as average

    both = (f"s3://{BUCKET}/tools/step-6", str(local_run[1]))
    assert generated(both[0]) == generated(both[1])
    starts = [
        run_trainer(tmp_path / f"from{i}", 1, [*tiny_run(2), "--checkpoint.initial_load_path", p])
        for i, p in enumerate(both)
    ]
    assert [r["loss"] for r in starts[0]] == [r["loss"] for r in starts[1]]
    assert "initialized model from the checkpoint s3://" in rank_logs(tmp_path / "from0", 1)
    for i, step in enumerate(both):
        _script("convert_to_hf").main([step, str(tmp_path / f"hf{i}"), "--max-seq-len", "32"])
    ours, theirs = (load_file(str(tmp_path / f"hf{i}" / "model.safetensors")) for i in (0, 1))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    average(["--checkpoints", *both, "--out", str(tmp_path / "avg")])
    got, want = load_dcp_model_state(tmp_path / "avg"), load_dcp_model_state(local_run[1])
    assert all(torch.equal(got[k], v) for k, v in want.items())


@SERVED
def test_a_two_rank_save_resumes_on_one_rank(s3, straight, tmp_path):
    """Saved by FSDP on 2 ranks, uploading in the background (async saves: DCP's saving
    process), resumed in one process: DCP reshards from the bucket."""
    fsdp = ["--parallelism.data_parallel_shard_degree", "2", "--checkpoint.async_mode", "async"]
    first = run_trainer(tmp_path / "a", 2, [*tiny_run(STEPS), *folder("layout"), *fsdp])
    assert [r["loss"] for r in first] == pytest.approx(straight, rel=1e-5)
    stop_after(s3, "layout", 4)
    second = run_trainer(tmp_path / "b", 1, [*tiny_run(STEPS), *folder("layout")])
    assert [r["loss"] for r in second] == pytest.approx(straight[4:], rel=1e-5)


@SERVED
def test_a_torn_and_a_corrupted_step_are_skipped(s3, straight, tmp_path):
    """step-6's upload torn before its marker, one of step-4's objects rewritten with other
    bytes of the same size: the resume takes step-2, says why, and trains on to the
    uninterrupted run's losses."""
    run_trainer(tmp_path / "a", 1, [*tiny_run(STEPS), *folder("damaged")])
    s3.delete_object(Bucket=BUCKET, Key="damaged/step-6/.complete")
    shard = next(k for k in keys(s3, BUCKET, "damaged/step-4/") if k.endswith(".distcp"))
    body = s3.get_object(Bucket=BUCKET, Key=shard)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=shard, Body=bytes(b ^ 0xFF for b in body))
    resumed = run_trainer(tmp_path / "b", 1, [*tiny_run(STEPS), *folder("damaged")])
    log = rank_logs(tmp_path / "b", 1)
    assert "resumed from s3://titan-ckpt/damaged/step-2 at step 2" in log
    assert "step-4 is unusable" in log and "fails its checksum" in log
    assert "step-6 is unusable (incomplete" in log
    assert [r["loss"] for r in resumed] == straight[2:]


@SERVED
@pytest.mark.needs("transformers")
def test_an_hf_export_into_the_bucket_is_the_local_export(s3, tmp_path, monkeypatch):
    """A 2-rank run's final HF export into the bucket (assembled under the dump folder, then
    uploaded, each rank its share of the files, the marker last): the same files as the same
    run exporting to a disk; a download of the prefix loads in transformers; a run started
    from the folder in the bucket starts at the loss it starts at from the disk."""
    from safetensors.torch import load_file

    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "cache"))  # the bucket's HF copy
    export = ["--checkpoint.last_save_in_hf", "--parallelism.data_parallel_shard_degree", "2"]
    run_trainer(tmp_path / "local", 2, [*tiny_run(2), *EVERY_2, *export])
    run_trainer(tmp_path / "bucket", 2, [*tiny_run(2), *folder("hf"), *export])
    local = tmp_path / "local" / "dump" / "checkpoint" / "step-2"
    names = sorted(steps_in(s3, "hf")["step-2"])
    assert set(names) == {f.name for f in local.iterdir()}  # the marker too
    assert not (tmp_path / "bucket" / "dump" / ".hf_export" / "step-2").exists()
    download = tmp_path / "download"
    download.mkdir()
    for name in names:
        s3.download_file(BUCKET, f"hf/step-2/{name}", str(download / name))
    for name in (f.name for f in local.glob("*.safetensors")):
        want, got = load_file(str(local / name)), load_file(str(download / name))
        assert set(want) == set(got) and all(torch.equal(got[k], v) for k, v in want.items())
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(download), dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    start = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path"]
    starts = [
        run_trainer(tmp_path / f"from{i}", 1, [*tiny_run(1), *start, where])
        for i, where in enumerate((f"s3://{BUCKET}/hf/step-2", str(local)))
    ]
    assert starts[0][0]["loss"] == starts[1][0]["loss"]
    assert generated(f"s3://{BUCKET}/hf/step-2") == generated(str(local))


@SERVED
def test_data_read_from_the_bucket_trains_as_the_local_files(s3, tmp_path, monkeypatch):
    """A folder of JSON-lines files, a token-shard folder and the validation set in the
    bucket: the same losses and validation loss as the same data on disk (raw files are
    tokenized into the local token cache as local files are; a shard folder is copied into
    it once, since its memmaps read local files)."""
    from pathlib import Path

    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "cache"))
    corpus = Path("assets/corpus/kjv_valid.jsonl").resolve()
    s3.upload_file(str(corpus), BUCKET, f"data/corpus/{corpus.name}")
    valid = ["--validation.enable", "--validation.freq", "3", "--validation.steps", "1"]

    def run(name: str, data: str, validation: str) -> tuple[list, list]:
        argv = [*tiny_run(3), "--training.dataset_path", data, *valid]
        rows = run_trainer(tmp_path / name, 1, [*argv, "--validation.dataset_path", validation])
        val = (tmp_path / name / "dump" / "validation.jsonl").read_text().splitlines()
        return [r["loss"] for r in rows], [json.loads(v)["val_loss"] for v in val]

    # the launcher's checks read the bucket's files as they read local ones
    from titan.components.data.content_check import check_content
    from titan.config import parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args([*tiny_run(1), "--training.dataset_path", f"s3://{BUCKET}/data/corpus"])
    check_content(job, plan_run(job, 1).tokenizer)
    local = run("local", str(corpus), str(corpus))
    assert run("bucket", f"s3://{BUCKET}/data/corpus", f"s3://{BUCKET}/data/corpus") == local
    shards = next((tmp_path / "cache").glob("tokens-*"))  # the local run's token cache
    for f in shards.iterdir():
        s3.upload_file(str(f), BUCKET, f"data/shards/{f.name}")
    assert run("shards", f"s3://{BUCKET}/data/shards", str(corpus)) == local
    logs = rank_logs(tmp_path / "shards", 1)
    assert "copying the token shards s3://" in logs
    assert "Found credentials" not in logs  # the store client's INFO chatter is kept out


@SERVED
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--checkpoint.folder", "s3://no-such-bucket/run"],
            r"checkpoint.folder = 's3://no-such-bucket/run': the bucket 'no-such-bucket' does "
            r"not exist",
        ),
        (
            [
                "--checkpoint.initial_load_path",
                f"s3://{BUCKET}/nothing-here",
                "--checkpoint.initial_load_in_hf",
            ],
            r"checkpoint.initial_load_path = 's3://titan-ckpt/nothing-here': no config.json in",
        ),
        (  # the launcher mirrors a URL dump folder: a trainer started alone cannot
            ["--job.dump_folder", f"s3://{BUCKET}/dump"],
            r"job.dump_folder = 's3://titan-ckpt/dump': a URL dump folder is written through "
            r"a local mirror that the launcher uploads; start the run with run_train.sh",
        ),
    ],
)
def test_what_cannot_work_is_one_line_before_launch(s3, flags, message):
    with pytest.raises(ConfigError, match=message):
        planned(["--checkpoint.enable", *flags])


def planned(argv: list[str]) -> None:
    """The checks the launcher makes before any rank starts."""
    from titan.config import parse_args
    from titan.plan.run_plan import plan_run

    plan_run(parse_args([*tiny_run(1), *argv]), 1)


@SERVED
def test_an_unreachable_endpoint_and_missing_credentials_are_named(s3, monkeypatch):
    argv = ["--checkpoint.enable", "--checkpoint.folder", f"s3://{BUCKET}/run"]
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    forget_clients()
    try:
        with pytest.raises(ConfigError, match=r"cannot reach http://127.0.0.1:9"):
            planned(argv)
        monkeypatch.undo()
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        forget_clients()
        with pytest.raises(ConfigError, match=r"no credentials for s3://"):
            planned(argv)
    finally:
        monkeypatch.undo()
        forget_clients()


@SERVED
def test_a_url_dump_folder_is_mirrored_and_its_histories_fetched(s3, tmp_path, monkeypatch):
    """The launcher's mirror of job.dump_folder = s3://...: the workers get a local folder and
    checkpoints under the URL; uploads are of what changed (never the HF staging or a temp
    file), nothing is deleted from the store, another machine fetches the top-level histories,
    and a file a killed launcher left unsent is uploaded, not overwritten, by the next."""
    from titan.config import parse_args
    from titan.launcher.dump_mirror import for_job

    url = f"s3://{BUCKET}/dump-mirror"
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "node-a"))
    job = parse_args([*tiny_run(1), "--checkpoint.enable", "--job.dump_folder", url])
    mirror = for_job(job)
    local = mirror.local
    assert mirror.redirect(job) == [
        "--job.dump_folder",
        str(local),
        "--checkpoint.folder",
        f"{url}/checkpoint",
    ]
    assert local.is_relative_to(tmp_path / "node-a") and job.job.dump_folder == str(local)
    planned(["--checkpoint.enable", "--job.dump_folder", str(local)])  # the workers' view
    assert mirror.fetch() == 0  # a new run

    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    (local / "tb" / "run" / "rank_0").mkdir(parents=True)
    (local / "tb" / "run" / "rank_0" / "events").write_text("e1")
    (local / ".hf_export").mkdir()
    (local / ".hf_export" / "model.safetensors").write_text("staged")
    (local / "metrics.jsonl.tmp").write_text("half")
    assert mirror.push() == []
    stored = ["dump-mirror/metrics.jsonl", "dump-mirror/tb/run/rank_0/events"]
    assert keys(s3, BUCKET, "dump-mirror/") == stored

    s3.delete_object(Bucket=BUCKET, Key="dump-mirror/tb/run/rank_0/events")
    with open(local / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    (local / "metrics.jsonl.tmp").unlink()
    assert mirror.push() == []  # the unchanged event file is not sent again
    assert keys(s3, BUCKET, "dump-mirror/") == ["dump-mirror/metrics.jsonl"]
    body = s3.get_object(Bucket=BUCKET, Key="dump-mirror/metrics.jsonl")["Body"].read()
    assert body == b'{"step": 1}\n{"step": 2}\n'
    (local / "metrics.jsonl").rename(local / "metrics.1.jsonl")
    mirror.push()
    assert "dump-mirror/metrics.jsonl" in keys(s3, BUCKET, "dump-mirror/")  # never deleted

    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "node-b"))
    other = for_job(parse_args(["--job.dump_folder", url]))
    assert other.local != local and other.fetch() == 2  # metrics.jsonl and metrics.1.jsonl
    assert (other.local / "metrics.jsonl").read_bytes() == body
    assert not (other.local / "tb").exists()  # a new start writes its own events

    with open(other.local / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n')  # ... and the launcher is killed before its upload
    again = for_job(parse_args(["--job.dump_folder", url]))
    again.fetch()
    final = body + b'{"step": 3}\n'
    assert (again.local / "metrics.jsonl").read_bytes() == final
    assert s3.get_object(Bucket=BUCKET, Key="dump-mirror/metrics.jsonl")["Body"].read() == final


@SERVED
def test_a_url_dump_folder_in_a_missing_bucket_is_refused(s3):
    from titan.config import parse_args
    from titan.launcher.dump_mirror import for_job

    job = parse_args(["--job.dump_folder", "s3://no-such-bucket/run"])
    with pytest.raises(ConfigError, match=r"job.dump_folder = 's3://no-such-bucket/run': the "):
        for_job(job)


@pytest.mark.needs("s3fs", "upath")
def test_a_url_folder_is_a_path_of_its_store():
    """The folder rules' pathlib calls on a URL: joining, names; a relative checkpoint.folder
    stays under the dump folder, an absolute URL is its own root."""
    from pathlib import Path

    from titan.components.checkpoint.storage import checkpoint_root, is_remote

    root = checkpoint_root("outputs/run", f"s3://{BUCKET}/run")
    step = root / "step-4"
    assert str(step) == f"s3://{BUCKET}/run/step-4" and step.name == "step-4"
    assert is_remote(step) and not is_remote(Path("outputs")) and not is_remote("file:///x")
    assert checkpoint_root("outputs/run", "checkpoint") == Path("outputs/run/checkpoint")


@pytest.mark.needs("upath")
def test_a_scheme_whose_package_is_absent_names_its_extra():
    import importlib.util

    from titan.components.checkpoint.storage import missing_package

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    assert missing_package("gs://bucket/run") == (
        "gs:// paths need gcsfs: pip install 'titan[gcs]'"
    )
    assert missing_package("/local/folder") is None
