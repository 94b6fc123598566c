"""The vocabulary a plan sizes: the tokenizer's, said in one line when it is not the flavor's
(the 8B configs with the bundled 2048-token tokenizer planned a 2048 vocabulary unseen); the
planner, which needs the tokenizer only for that size, plans the flavor's when it is missing."""

import json
import subprocess
import sys

import pytest

from titan.config import ConfigError, parse_args
from titan.models.llama3.args import LLAMA3_FLAVORS
from titan.plan.run_plan import plan_run, vocabulary_note
from titan.runtime.paths import REPO_ROOT

BUNDLED = "assets/tokenizer/tokenizer.json"


def job(*argv, plan_only=False):
    j = parse_args(["--job.config_file", "train_configs/debug_model.toml", *argv])
    j.plan_only = plan_only
    return j


def test_a_missing_tokenizer_fails_a_run_but_the_planner_sizes_the_flavor(tmp_path):
    missing = ["--model.flavor", "1B", "--model.tokenizer_path", str(tmp_path / "none")]
    with pytest.raises(ConfigError, match="tokenizer .* does not exist"):
        plan_run(job(*missing), world_size=1)
    planned = job(*missing, plan_only=True)
    run = plan_run(planned, world_size=1)
    assert run.model_args.vocab_size == LLAMA3_FLAVORS["1B"].vocab_size == 128256
    assert vocabulary_note(planned, run) == (
        f"tokenizer '{tmp_path / 'none'}' not found: planned with the 1B flavor's 128256-token "
        "vocabulary (training needs the tokenizer)"
    )


def test_a_tokenizer_of_another_size_is_said():
    other = job("--model.flavor", "1B", "--model.tokenizer_path", BUNDLED)
    run = plan_run(other, world_size=1)
    assert run.model_args.vocab_size == 2048
    assert vocabulary_note(other, run) == (
        f"the 1B flavor has a 128256-token vocabulary, the tokenizer '{BUNDLED}' 2048: the "
        "embedding and output layer are sized for 2048"
    )
    same = job()  # the debug model and the bundled tokenizer: 2048 both
    assert vocabulary_note(same, plan_run(same, world_size=1)) is None


def test_plan_cli_plans_the_flavor_vocabulary_and_says_so(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan.planner",
            "--json",
            "--model.flavor",
            "1B",
            "--model.tokenizer_path",
            str(tmp_path / "none"),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("titan: note: tokenizer ") and proc.stderr.count("\n") == 1
    report = json.loads(proc.stdout)
    assert report["model"] == {"name": "llama3", "flavor": "1B", "vocab_size": 128256}
    # fp32 weights of Llama 3.2 1B (tied embedding, counted once): 1,235,814,400 parameters
    assert (
        report["ranks"][0]["params_bytes"]
        == 4 * LLAMA3_FLAVORS["1B"].num_params()
        == 4 * 1_235_814_400
    )
