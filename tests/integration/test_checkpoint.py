"""Checkpoints: exact resume (bitwise on CPU fp32), resume onto other layouts, retention,
partial loads, seed checkpoints, damaged checkpoints, HF import.

Runs are forked ranks on CPU (`train`): a resume is new processes reading the disk either way.
Refusals, whose one line and exit code come through the launcher, are launched."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.integration.harness import (
    COMMON,
    FAST,
    RTOL,
    dp_batch,
    launch,
    losses,
    read_metrics,
    train,
)
from titan.runtime.paths import REPO_ROOT

# a resume is proven by the steps after it, each equal bit for bit: a few suffice
STEPS = 8
STOP = 4  # the stop (and save) step of the interrupted runs
BASE = [*COMMON, "--training.steps", str(STEPS), "--checkpoint.interval", str(STOP)]
CK = ["--checkpoint.enable"]


def steps_on_disk(dump):
    root = dump / "checkpoint"
    return sorted(
        int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / ".complete").is_file()
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """straight(nproc, layout): losses of STEPS uninterrupted steps, each layout launched once
    for the whole module (checkpointing does not change them, bit for bit)."""
    runs = {}

    def run(nproc, layout):
        key = (nproc, tuple(layout))
        if key not in runs:
            dump = tmp_path_factory.mktemp("straight")
            train(nproc, [*BASE, *layout], dump, timeout=600)
            runs[key] = losses(dump)
        return runs[key]

    return run


def straight_then_resumed(straight, tmp_path, nproc, layout, extra=(), resume_step=STOP):
    """(losses of STEPS straight steps, losses of STOP steps + resume from `resume_step` + the
    rest).

    The save at the stop step is always synchronous; resuming from an earlier interval
    save proves an async one, whose copy overlapped the next step's forward/backward.
    """
    resumed = tmp_path / "resumed"
    first = train(
        nproc,
        [*BASE, *layout, *CK, *extra, "--training.exit_at_step", str(STOP)],
        resumed,
        timeout=600,
    )
    assert sorted(losses(resumed)) == list(range(1, STOP + 1))
    assert steps_on_disk(resumed) == sorted({resume_step, STOP})
    if resume_step != STOP:  # the async save's copy is awaited within the next step
        log = first.stderr
        staged = log.index(f"checkpoint step {resume_step} staged")
        assert staged < re.search(rf"step:\s+{resume_step + 1}/", log).start()
        assert "Traceback" not in log  # the saving process is stopped, not left to die
    proc = train(
        nproc,
        [*BASE, *layout, *CK, *extra, "--checkpoint.load_step", str(resume_step)],
        resumed,
        timeout=600,
    )
    assert "resumed from" in proc.stderr and f"step-{resume_step}" in proc.stderr
    return straight(nproc, layout), losses(resumed)


@pytest.mark.slow("three runs of up to 4 ranks a case: straight, interrupted, resumed")
@pytest.mark.parametrize(
    "case,nproc,layout,extra,resume_step",
    [
        ("1rank", 1, dp_batch(1), [], STOP),
        ("fsdp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2", *dp_batch(2)], [], STOP),
        ("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2", *dp_batch(1)], [], STOP),
        # FSDP 2 is resumed from an async save only: the sync save path is the other cases'
        (
            "fsdp2_async",
            2,
            dp_batch(2),
            ["--checkpoint.async_mode", "async", "--checkpoint.interval", "2"],
            2,
        ),
    ],
)
def test_exact_resume_is_bitwise(case, nproc, layout, extra, resume_step, straight, tmp_path):
    uninterrupted, resumed = straight_then_resumed(
        straight, tmp_path, nproc, layout, extra, resume_step
    )
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == uninterrupted  # bit for bit, every step, data order included


@pytest.mark.slow("a 4-rank save resumed on two 4-rank layouts")
def test_resume_onto_other_layouts(straight, tmp_path):
    fsdp4 = [*dp_batch(4)]
    reference = straight(2, dp_batch(2))  # every layout trains to these losses (within RTOL)
    saved = tmp_path / "saved"
    train(4, [*BASE, *fsdp4, *CK, "--training.exit_at_step", str(STOP)], saved, timeout=600)
    for name, nproc, layout in [
        ("fsdp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2", *dp_batch(2)]),
        ("pp2_fsdp2", 4, ["--parallelism.pipeline_parallel_degree", "2", *dp_batch(2)]),
    ]:
        dump = tmp_path / name
        shutil.copytree(saved, dump)
        train(nproc, [*BASE, *layout, *CK], dump, timeout=600)
        got = losses(dump)
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in range(STOP + 1, STEPS + 1):
            assert abs(got[step] - reference[step]) <= RTOL * reference[step], (name, step)


def test_interval_first_step_and_keep_latest_k(tmp_path):
    common = [
        *BASE,
        *CK,
        "--training.steps",
        "7",
        "--checkpoint.interval",
        "3",
        "--checkpoint.enable_first_step_checkpoint",
        *dp_batch(1),
    ]
    dump = tmp_path / "all"
    train(1, [*common, "--checkpoint.keep_latest_k", "0"], dump)
    assert steps_on_disk(dump) == [1, 3, 6, 7]
    dump = tmp_path / "k2"
    train(1, [*common, "--checkpoint.keep_latest_k", "2"], dump)
    assert steps_on_disk(dump) == [6, 7]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-6", "step-7"]


def file_bytes(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused_in_one_line(proc, *fragments):
    """Exit 2 from the launcher, before any worker: one line naming the problem."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titan: config error:"), proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow("two runs and two refused launches")
def test_damaged_newest_checkpoint_falls_back_and_another_model_is_refused(straight, tmp_path):
    """4 KiB of 0xFF in the middle of the newest save (its size unchanged): the resume skips it,
    naming the file, and continues exactly from the save before. Then a run of another model
    (the tied flavor) is refused from that folder, and as an initial load, leaving every file
    as it was."""
    common = [
        *BASE,
        *CK,
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        *dp_batch(1),
    ]
    dump = tmp_path / "run"
    train(1, [*common, "--training.exit_at_step", "4"], dump, timeout=300)
    step2 = file_bytes(dump / "checkpoint" / "step-2")
    shard = next((dump / "checkpoint" / "step-4").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    proc = train(1, common, dump, timeout=300)
    assert f"step-4 is unusable (file {shard.name} fails its checksum" in proc.stderr
    assert "resumed from" in proc.stderr and "step-2" in proc.stderr
    assert losses(dump) == straight(1, dp_batch(1))
    assert file_bytes(dump / "checkpoint" / "step-2") == step2

    before = file_bytes(dump)
    tied = ["--model.flavor", "debugmodel_tied"]
    proc = launch(1, [*common, *tied], dump, timeout=120, check=False)
    refused_in_one_line(
        proc,
        "cannot resume from",
        f"step-{STEPS}",
        "tie_word_embeddings False (checkpoint) vs True (this run)",
    )
    proc = launch(
        1,
        [*BASE, *tied, "--checkpoint.initial_load_path", str(dump / "checkpoint" / "step-2")],
        tmp_path / "fresh",
        timeout=120,
        check=False,
    )
    refused_in_one_line(proc, "checkpoint.initial_load_path", "tie_word_embeddings")
    assert file_bytes(dump) == before and not (tmp_path / "fresh").exists()


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    dump = tmp_path / "run"
    stop = ["--training.exit_at_step", str(STOP)]
    train(1, [*BASE, *CK, *stop, *dp_batch(1)], dump, timeout=300)
    (dump / "checkpoint" / f"step-{STOP}" / ".metadata").write_bytes(b"garbage")
    proc = launch(1, [*BASE, *CK, *dp_batch(1)], dump, timeout=300, check=False)
    refused_in_one_line(proc, "no usable checkpoint", "file .metadata has 7 bytes")
    assert sorted(losses(dump)) == list(range(1, STOP + 1))  # the history was not overwritten


@pytest.fixture
def small_disk(tmp_path):
    """A 100 MiB tmpfs: room for one debug-model save (70 MB), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=100M", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_full_disk_stops_before_writing_and_keeps_the_last_checkpoint(small_disk):
    """The save of step 4 does not fit next to step 2's: the run stops before writing it, in
    one line naming the folder, the space needed and free; step 2 stays intact (its checksums
    as written), and a relaunch is refused before any worker starts."""
    from titan.components.checkpoint.folders import folder_problem

    dump = small_disk / "run"
    run = [*FAST, "--training.steps", "4", *CK, "--checkpoint.interval", "2"]
    proc = launch(1, run, dump, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("titan:")]
    assert len(line) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "step-4 not saved" in line[0] and "a save needs 0.07 GiB" in line[0]
    assert "GiB free" in line[0] and str(dump / "checkpoint") in line[0]
    assert steps_on_disk(dump) == [2]
    assert [p.name for p in (dump / "checkpoint").iterdir()] == ["step-2"]
    assert folder_problem(dump / "checkpoint" / "step-2", "full") is None
    before = file_bytes(dump)
    proc = launch(1, run, dump, timeout=120, check=False)
    refused_in_one_line(proc, "a save needs 0.07 GiB", "GiB free")
    assert file_bytes(dump) == before


def test_exclude_from_loading_and_model_only_initial_load(tmp_path):
    # 10 steps trained: the model-only load starts far below the initial loss
    steps = ["--training.steps", "12", "--checkpoint.interval", "10"]
    common = [*COMMON, *steps, *dp_batch(1)]
    src = tmp_path / "src"
    train(1, [*common, *CK, "--training.exit_at_step", "10"], src, timeout=300)
    step10 = src / "checkpoint" / "step-10"
    # model only: weights of step 10, but step, data, optimizer and lr start from scratch
    fresh = tmp_path / "model_only"
    train(
        1,
        [*common, *CK, "--checkpoint.initial_load_path", str(step10), "--training.steps", "3"],
        fresh,
        timeout=300,
    )
    got = losses(fresh)
    assert sorted(got) == [1, 2, 3]
    first_run = losses(src)
    assert got[1] < first_run[1] - 1.0  # trained weights: far below the initial loss
    # resume excluding the dataloader: step and weights restored, data restarts at batch 0
    excl = tmp_path / "excl"
    shutil.copytree(src, excl)
    train(1, [*common, *CK, "--checkpoint.exclude_from_loading", "dataloader"], excl, timeout=300)
    resumed_full = tmp_path / "full"
    shutil.copytree(src, resumed_full)
    train(1, [*common, *CK], resumed_full, timeout=300)
    assert sorted(losses(excl)) == list(range(1, 13))
    assert losses(excl)[11] != losses(resumed_full)[11]


def test_seed_checkpoint_gives_same_losses_across_layouts(straight, tmp_path):
    seed_dump = tmp_path / "seed"
    train(
        1,
        [*BASE, *CK, "--checkpoint.create_seed_checkpoint", "--training.seed", "7"],
        seed_dump,
        timeout=300,
    )
    assert steps_on_disk(seed_dump) == [0]
    assert read_metrics(seed_dump) == []
    runs = {}
    for name, nproc, layout in [("one", 1, dp_batch(1)), ("fsdp2", 2, dp_batch(2))]:
        dump = tmp_path / name
        shutil.copytree(seed_dump, dump)
        train(nproc, [*BASE, *CK, "--training.steps", "5", *layout], dump, timeout=300)
        runs[name] = losses(dump)
    assert sorted(runs["one"]) == [1, 2, 3, 4, 5]
    for s in runs["one"]:
        assert abs(runs["one"][s] - runs["fsdp2"][s]) <= RTOL * runs["one"][s]
    # the seed's weights were used: step 1 (before any update) differs from a seed-0 run's
    assert runs["one"][1] != straight(1, dp_batch(1))[1]


def test_hf_export_then_initial_load_in_hf(tmp_path):
    src = tmp_path / "src"
    train(
        1,
        [*BASE, *CK, "--training.steps", "4", "--checkpoint.last_save_model_only", *dp_batch(1)],
        src,
        timeout=300,
    )
    marker = json.loads((src / "checkpoint" / "step-4" / ".complete").read_text())
    assert marker["model_only"] is True
    hf = tmp_path / "hf"
    subprocess.run(
        [
            sys.executable,
            "scripts/convert_to_hf.py",
            str(src / "checkpoint"),
            str(hf),
            "--flavor",
            "debugmodel",
            "--max-seq-len",
            "64",
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    from_hf, from_dcp = tmp_path / "from_hf", tmp_path / "from_dcp"
    common = [*BASE, *CK, "--training.steps", "3", *dp_batch(1)]
    train(
        1,
        [*common, "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"],
        from_hf,
        timeout=300,
    )
    train(
        2,
        [
            *common[:-2],
            *dp_batch(2),
            "--checkpoint.initial_load_path",
            str(src / "checkpoint" / "step-4"),
        ],
        from_dcp,
        timeout=300,
    )
    a, b = losses(from_hf), losses(from_dcp)
    assert sorted(a) == [1, 2, 3]
    for s in a:
        assert abs(a[s] - b[s]) <= RTOL * a[s]


@pytest.mark.slow("three 2-rank runs with validation and a refused launch")
def test_streamed_dataset_resumes_exactly_with_validation(tmp_path):
    """Local files read through the streaming path (as hub datasets are): each dp rank reads
    its own shard, a resume on the same layout continues every rank's stream exactly, and
    validation on a streamed set ends (its shards end at different batches on each rank)."""
    valid = tmp_path / "valid.jsonl"  # 5 documents: 3 on one rank, 2 on the other
    lines = (REPO_ROOT / "assets" / "corpus" / "kjv_valid.jsonl").read_text().splitlines()
    valid.write_text("\n".join(lines[:5]) + "\n")
    stream = [
        "--training.dataset_streaming",
        "--validation.enable",
        "--validation.dataset_path",
        str(valid),
        "--validation.dataset_streaming",
        "--validation.freq",
        "4",
        "--validation.local_batch_size",
        "4",
        "--training.steps",
        "8",
        "--checkpoint.interval",
        "4",
        *dp_batch(2),
    ]
    train(2, [*BASE, *stream], tmp_path / "straight", timeout=600)
    resumed = tmp_path / "resumed"
    train(2, [*BASE, *stream, *CK, "--training.exit_at_step", "4"], resumed, timeout=600)
    proc = train(2, [*BASE, *stream, *CK], resumed, timeout=600)
    assert "resumed from" in proc.stderr and "step-4" in proc.stderr
    straight = losses(tmp_path / "straight")
    assert sorted(straight) == list(range(1, 9)) and losses(resumed) == straight

    def val(dump):
        return [json.loads(x) for x in (dump / "validation.jsonl").read_text().splitlines()]

    assert [v["step"] for v in val(tmp_path / "straight")] == [4, 8]
    assert val(resumed) == val(tmp_path / "straight")  # same batches, same loss, after resume
    assert val(resumed)[1]["val_loss"] < val(resumed)[0]["val_loss"]
    # per-rank streams cannot move to another dp degree: refused, naming the way out
    proc = launch(
        1,
        [*BASE, *stream, *CK, "--training.steps", "12", *dp_batch(1)],
        resumed,
        timeout=600,
        check=False,
    )
    assert proc.returncode != 0 and 'dataset_stream_order = "global"' in proc.stderr


def test_stream_in_global_order_resumes_on_another_dp_degree(tmp_path):
    """Every rank reads the whole stream and keeps its slice of each global batch: a 2-rank
    checkpoint resumes on 1 rank and continues the 1-rank losses."""
    stream = [
        "--training.dataset_streaming",
        "--training.dataset_stream_order",
        "global",
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "3",
    ]
    train(1, [*BASE, *stream, *dp_batch(1)], tmp_path / "straight", timeout=600)
    resumed = tmp_path / "resumed"
    train(
        2, [*BASE, *stream, *CK, *dp_batch(2), "--training.exit_at_step", "3"], resumed, timeout=600
    )
    proc = train(1, [*BASE, *stream, *CK, *dp_batch(1)], resumed, timeout=600)
    assert "resumed from" in proc.stderr and "step-3" in proc.stderr
    a, b = losses(tmp_path / "straight"), losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in a:
        assert abs(a[s] - b[s]) <= RTOL * a[s], (s, a[s], b[s])


def test_resume_onto_a_larger_global_batch_trains_the_next_sequences(tmp_path):
    """A 1-rank checkpoint at step 6 (global batch 8: sequences 0-47 trained), resumed on 2
    ranks with training.global_batch_size unset (global batch 16): step 7 trains sequences
    48-63, proven by its loss, which equals the cross-entropy of the step-6 weights on those
    sequences (and not on 96-111, where counting batches of the new size would land)."""
    import torch
    import torch.nn.functional as F

    from titan.components.checkpoint import folders
    from titan.components.data.dataloader import DataShard, build_dataloader
    from titan.components.data.tokenizer import Tokenizer
    from titan.config import parse_args
    from titan.models.spec import get_train_spec

    dump = tmp_path / "run"
    run = [*COMMON, *CK, "--training.local_batch_size", "8"]
    train(1, [*run, "--training.steps", "6", "--checkpoint.interval", "6"], dump, timeout=300)
    proc = train(2, [*run, "--training.steps", "7"], dump, timeout=300)
    assert "the data continues at sequence 48 of the global stream" in proc.stderr
    assert re.search(
        r"layout change: step-6 .*global_batch_size 8 -> 16.*the first sequence "
        r"not yet trained",
        proc.stderr,
    ), proc.stderr[-3000:]
    step7 = next(r for r in read_metrics(dump) if r["step"] == 7)["loss"]

    job = parse_args(["--job.config_file", "train_configs/debug_model.toml", *run])
    tokenizer = Tokenizer(job.model.tokenizer_path)
    stream = iter(
        build_dataloader(
            job.training,
            tokenizer=tokenizer,
            shard=DataShard(0, 1),
            global_batch_size=8,
            sections=job.extensions,
        )
    )
    batches = [next(stream) for _ in range(14)]  # sequences 0-111, in batches of 8
    spec = get_train_spec("llama3")
    model = spec.build_meta(
        spec.flavors["debugmodel"].with_updates(vocab_size=tokenizer.vocab_size, max_seq_len=64)
    )
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.load_state_dict(
        folders.load_dcp_model_state(dump / "checkpoint" / "step-6"), strict=False
    )

    def loss_on(first_batch: int) -> float:
        x = torch.cat([batches[first_batch]["input_ids"], batches[first_batch + 1]["input_ids"]])
        y = torch.cat([batches[first_batch]["labels"], batches[first_batch + 1]["labels"]])
        with torch.no_grad():
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()

    assert abs(step7 - loss_on(6)) <= 1e-5 * step7, (step7, loss_on(6))
    assert abs(step7 - loss_on(12)) > 1e-3 * step7
