"""A rank killed during an upload to object storage, under run_train.sh: the save it cut
short has no marker, torchrun restarts the job, and the restart resumes from the previous step
in the bucket (a real S3 server on loopback, tests/s3_server.py) with the uninterrupted run's
losses. The rest of object storage: tests/unit/test_object_storage.py."""

import pytest

from tests.integration.harness import COMMON, dp_batch, launch, losses, train
from tests.s3_server import keys, s3_server

BUCKET = "titan-launch"
BASE = [*COMMON, "--training.steps", "8", *dp_batch(2)]


@pytest.mark.needs("moto", "s3fs", "upath")
@pytest.mark.slow("a launch, a rank killed mid-upload and torchrun's restart")
def test_a_rank_killed_during_an_upload_resumes_from_the_previous_step(tmp_path):
    with s3_server(BUCKET) as s3:
        straight = tmp_path / "straight"
        train(2, BASE, straight)
        store = [
            "--checkpoint.enable",
            "--checkpoint.interval",
            "4",
            "--checkpoint.keep_latest_k",
            "0",
            "--checkpoint.folder",
            f"s3://{BUCKET}/killed",
        ]
        kill = [
            "--debug.kill_in_checkpoint_step",
            "8",
            "--debug.kill_in_checkpoint_phase",
            "writing",
            "--debug.kill_rank",
            "1",
        ]
        run = tmp_path / "run"
        proc = launch(
            2,
            [*BASE, *store, *kill],
            run,
            env={"MAX_RESTARTS": "1", "LOG_RANK": "0,1"},
            timeout=600,
        )
        assert "resumed from s3://titan-launch/killed/step-4 at step 4" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert losses(run) == losses(straight)
        stored = keys(s3, BUCKET, "killed/")
        assert {"killed/step-4/.complete", "killed/step-8/.complete"} <= set(stored)
