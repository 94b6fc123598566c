"""A run whose dump folder is a URL, under run_train.sh against a real S3 server on loopback
(tests/s3_server.py): a rank killed during an upload leaves a save with no marker, torchrun
restarts the job, and the restart resumes from the previous step in the bucket; a later job on
another machine (a fresh local mirror) fetches the run's history from the bucket and goes on.
The bucket's metrics.jsonl then holds the uninterrupted run's losses, once per step. The rest
of object storage: tests/unit/test_object_storage.py."""

import json

import pytest

from tests.integration.harness import COMMON, dp_batch, launch, losses, train
from tests.s3_server import keys, s3_server

BUCKET = "titan-launch"
URL = f"s3://{BUCKET}/run"
BASE = [*COMMON, "--training.steps", "8", *dp_batch(2)]
STORE = [
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.enable_tensorboard",
]


@pytest.mark.needs("moto", "s3fs", "upath")
@pytest.mark.slow("two launches, a rank killed mid-upload and torchrun's restart")
def test_a_url_dump_folder_survives_a_killed_upload_and_a_move_to_another_machine(tmp_path):
    with s3_server(BUCKET) as s3:
        straight = tmp_path / "straight"
        train(2, BASE, straight)
        kill = [
            "--debug.kill_in_checkpoint_step",
            "4",
            "--debug.kill_in_checkpoint_phase",
            "writing",
            "--debug.kill_rank",
            "1",
        ]
        first = launch(
            2,
            [*BASE, *STORE, *kill, "--training.exit_at_step", "6"],
            URL,
            env={"MAX_RESTARTS": "1", "LOG_RANK": "0,1", "TITAN_CACHE_DIR": str(tmp_path / "a")},
            timeout=600,
        )
        assert f"resumed from {URL}/checkpoint/step-2 at step 2" in first.stderr
        assert "Traceback" not in first.stderr
        second = launch(
            2,
            [*BASE, *STORE],
            URL,
            env={"TITAN_CACHE_DIR": str(tmp_path / "b")},  # another machine
            timeout=600,
        )
        assert f"resumed from {URL}/checkpoint/step-6 at step 6" in second.stderr
        assert "(2 files of the earlier run fetched)" in second.stderr

        body = s3.get_object(Bucket=BUCKET, Key="run/metrics.jsonl")["Body"].read().decode()
        records = [json.loads(line) for line in body.splitlines()]
        assert [r["step"] for r in records] == list(range(1, 9))
        assert {r["step"]: r["loss"] for r in records} == losses(straight)
        stored = keys(s3, BUCKET, "run/")
        complete = {k for k in stored if k.endswith("/.complete")}
        assert complete == {f"run/checkpoint/step-{n}/.complete" for n in (2, 4, 6, 8)}
        events = {k.split("/")[2] for k in stored if "/events.out.tfevents." in k}
        assert len(events) == 3  # the first start, torchrun's restart, the second job
        assert not any("/.hf_export" in k or k.endswith(".tmp") for k in stored)
