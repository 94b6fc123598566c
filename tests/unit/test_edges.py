"""Bad input at the edges of titan (side tools, scripts, absurd sizes) ends in one line naming
the problem and the fix, exit 2: never a traceback, never a silent acceptance."""

import os
import subprocess
import sys

import pytest

from titan.runtime.paths import REPO_ROOT


def one_line(argv: list[str], env: dict | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return proc.stderr


def test_download_without_network_is_one_line():
    err = one_line(
        [
            "scripts/download_hf_assets.py",
            "--repo",
            "meta-llama/Llama-3.1-8B",
            "--out",
            "/nonexistent-dir-for-test",
        ],
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert err.startswith("download_hf_assets: could not download meta-llama/Llama-3.1-8B")
    assert "check the network" in err


def test_data_loader_benchmark_refuses_too_few_steps():
    err = one_line(["benchmarks/data_loader.py", "--steps", "3"])
    assert "--steps 3: the first 10 steps are not timed; pass --steps 20 or more" in err


@pytest.mark.parametrize(
    "argv,why",
    [
        (
            ["--ngpu", "1000000000"],
            "--ngpu 1000000000 x --nnodes 1 = 1000000000 ranks: the "
            "planner plans up to 1048576 ranks",
        ),
        (["--ngpu", "1024", "--nnodes", "2048"], "= 2097152 ranks"),
        (["--device-memory", "0"], "--device-memory 0 bytes: must be > 0"),
        (
            ["--memory.device_memory_gib", "-3"],
            "memory.device_memory_gib = -3.0 (from command line",
        ),
    ],
)
def test_planner_refuses_absurd_sizes_at_once(argv, why, capsys):
    from titan.planner.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err


def test_the_planner_shards_for_any_world_size_without_a_chunk_per_rank():
    """FSDP pads a parameter's chunks to one per rank (10^5 ranks: 89 s and GBs to plan); in
    the planner's fake world its two lookups (its rank's chunk, the first) are served
    without the list, for any world size."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from titan.planner.memory import _Chunks, fake_world

    chunks = _Chunks(torch.arange(10.0), 10**9, 0)
    assert len(chunks) == 10**9 and len(chunks.real) == 10
    assert chunks[0].tolist() == [0.0] and chunks[10**9 - 1].numel() == 0
    real = _fsdp_param._chunk_with_empty
    with fake_world(4, 0):
        assert _fsdp_param._chunk_with_empty is _Chunks
    assert _fsdp_param._chunk_with_empty is real


def test_a_malformed_hf_config_is_named_before_launch(tmp_path):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,\n')
    job = parse_args(
        [
            "--checkpoint.initial_load_path",
            str(tmp_path),
            "--checkpoint.initial_load_in_hf",
            "--model.flavor",
            "from_hf",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"config\.json is not valid JSON \(line 2: .*\); fix "
        r"it or download the model's config\.json again",
    ):
        plan_run(job, 1)
