"""titan.tools.average: checkpoints averaged tensor by tensor, read back by training,
generation and transformers, in bounded memory."""

import json
import re
from pathlib import Path

import pytest
import torch

from tests.forked import run_trainer, run_workers, tiny_run
from titan.components.checkpoint.folders import (
    folder_problem,
    load_dcp_model_state,
    save_dcp_model_state,
)
from titan.components.checkpoint.hf_io import load_hf_state
from titan.runtime.paths import REPO_ROOT
from titan.tools.average import main

CK = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """A 4-step run's DCP steps 2 and 4, and their HF conversions (float32)."""
    from tests.unit.test_qwen3 import _script

    tmp = tmp_path_factory.mktemp("run")
    run_trainer(tmp, 1, [*tiny_run(4), *CK], deadline_s=120)
    root = tmp / "dump" / "checkpoint"
    dcp = [root / "step-2", root / "step-4"]
    hf = [tmp / "hf2", tmp / "hf4"]
    for step, out in zip(dcp, hf):
        args = [str(step), str(out), "--dtype", "float32", "--max-seq-len", "32"]
        _script("convert_to_hf").main([*args, "--tokenizer", str(REPO_ROOT / "assets/tokenizer")])
    return dcp, hf


def test_two_steps_average_to_their_mean(steps, tmp_path):
    (a, b), _ = steps
    main(["--checkpoints", str(a), str(b), "--out", str(tmp_path)])
    got, sa, sb = (load_dcp_model_state(p) for p in (tmp_path, a, b))
    assert got.keys() == sa.keys()
    for name in sa:  # 0.5 a + 0.5 b rounds once, as (a + b) / 2 does
        assert torch.equal(got[name], (sa[name] + sb[name]) / 2), name
    assert folder_problem(tmp_path, verify="full") is None  # every file as its checksum says
    marker, first = (json.loads((p / ".complete").read_text()) for p in (tmp_path, a))
    assert marker["model_only"] and marker["model"] == first["model"]
    assert marker["trained_with"] == first["trained_with"]


def test_weights_are_shares_of_their_sum(steps, tmp_path):
    (a, b), _ = steps
    main(["--checkpoints", str(a), str(b), "--weights", "1", "3", "--out", str(tmp_path)])
    got, sa, sb = (load_dcp_model_state(p) for p in (tmp_path, a, b))
    for name in sa:
        want = sa[name].double() * 0.25 + sb[name].double() * 0.75
        torch.testing.assert_close(got[name].double(), want, rtol=1e-6, atol=1e-7)


def test_training_and_generation_read_the_average(steps, tmp_path, capsys):
    """A step averaged with itself is that step: training started from either has the same
    losses, bitwise, and generation writes the same tokens."""
    from titan.tools.generate import main as generate

    (_, b), _ = steps
    avg = tmp_path / "avg"
    main(["--checkpoints", str(b), str(b), "--out", str(avg)])
    start = ["--checkpoint.initial_load_model_only", "--checkpoint.initial_load_path"]
    losses = [
        [r["loss"] for r in run_trainer(tmp_path / name, 1, [*tiny_run(2), *start, str(path)])]
        for name, path in (("from_step", b), ("from_average", avg))
    ]
    assert losses[0] == losses[1]
    texts = []
    for path in (b, avg):
        capsys.readouterr()
        generate(
            ["--checkpoint", str(path), "--prompt", "In the beginning", "--max-new-tokens", "8"]
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


def test_hf_folders_average_to_their_mean(steps, tmp_path):
    _, (a, b) = steps
    main(["--checkpoints", str(a), str(b), "--out", str(tmp_path)])
    got, sa, sb = (load_hf_state(p) for p in (tmp_path, a, b))
    assert got.keys() == sa.keys()
    for name in sa:
        assert torch.equal(got[name], (sa[name] + sb[name]) / 2), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in a.iterdir())


@pytest.mark.needs("transformers")
def test_an_averaged_hf_folder_loads_in_transformers(steps, tmp_path):
    from transformers import AutoModelForCausalLM

    _, (_, b) = steps
    main(["--checkpoints", str(b), str(b), "--out", str(tmp_path)])
    tokens = torch.tensor([[1, 17, 230, 5, 99]])
    with torch.no_grad():
        want, got = (AutoModelForCausalLM.from_pretrained(p)(tokens).logits for p in (b, tmp_path))
    assert torch.equal(got, want)


def _bad(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_inputs_are_one_line_and_leave_the_output_alone(steps, tmp_path, capsys):
    (a, b), (ha, _) = steps
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    two = ["--checkpoints", str(a), str(b)]
    assert "exists and is not empty; pass --overwrite" in _bad([*two, "--out", str(out)], capsys)
    err = _bad([*two, "--weights", "1", "--out", str(out), "--overwrite"], capsys)
    assert "--weights gives 1 numbers for 2 checkpoints" in err
    err = _bad(["--checkpoints", str(a), str(ha), "--out", str(out), "--overwrite"], capsys)
    assert "mixes DCP steps and HF folders" in err
    other = tmp_path / "other"  # another model: one tensor fewer
    state = load_dcp_model_state(a)
    state.pop(sorted(state)[0])
    save_dcp_model_state(state, other)
    err = _bad(["--checkpoints", str(a), str(other), "--out", str(out), "--overwrite"], capsys)
    assert "hold different tensors" in err or "records another model" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # nothing was touched


def _peak_over_base(rank, world_size, inputs, out):
    """The growth of resident memory while averaging `inputs`, in a second run: the first
    faults in the code the run uses (a forked child maps its parent's library pages afresh,
    which counts too); big blocks are allocated and freed by mmap (a fixed threshold), so
    freed memory is returned, not reused unseen."""
    import ctypes

    def status(key: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, not adaptive
    main(["--checkpoints", *map(str, inputs), "--out", str(out / "warm")])
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to now
    base = status("VmRSS")
    main(["--checkpoints", *map(str, inputs), "--out", str(out / "measured")])
    return status("VmHWM") - base


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's RSS counters")
def test_memory_holds_one_sum_and_one_chunk(tmp_path):
    """Three checkpoints of a 64 MiB tensor: resident memory grows by the tensor's sum and
    the chunk being added (2 x 64 MiB), not by the inputs (3 x 64) or a copy of each."""
    mib = 2**20
    inputs = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        big, small = torch.randn(64 * mib // 4, generator=g), torch.randn(10, generator=g)
        inputs.append(save_dcp_model_state({"big": big, "small": small}, tmp_path / f"in{i}"))
        del big
    (peak,) = run_workers(_peak_over_base, 1, tmp_path, inputs, tmp_path, init_pg=False)
    assert peak < 2 * 64 * mib + 16 * mib, peak / mib
