"""Checkpoint integrity without a launch: checksums as written, damage of equal size, the
model a checkpoint holds, the space a save needs, and a save that fails part-way."""

import errno
import json
import sys
import zlib
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from titan.components.checkpoint import disk_space
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint.checkpointer import _write_failure
from titan.components.checkpoint.folders import CheckpointError, folder_problem, resume_candidate
from titan.components.checkpoint.identity import model_identity
from titan.config import ConfigError, parse_args
from titan.models.spec import get_train_spec
from titan.plan.run_plan import plan_run

LLAMA = get_train_spec("llama3")


def identity(flavor="debugmodel"):
    args = LLAMA.flavors[flavor].with_updates(vocab_size=2048, max_seq_len=64)
    return model_identity(LLAMA, flavor, args), args


def save_model(path: Path, flavor="debugmodel", seed=0, tie_copy=False, record=True) -> Path:
    """A model-only checkpoint of `flavor` with random weights (the copy of a tied pair stored
    too, equal to its owner, with `tie_copy`)."""
    ident, args = identity(flavor)
    g = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(s, generator=g) for n, s in LLAMA.state_shapes(args).items()}
    if not tie_copy:
        state = {n: state[n] for n in ident.shapes}
    else:
        for owner, copy in ident.ties:
            state[copy] = state[owner]
    return checkpoint.save_dcp_model_state(state, path, model=ident.record() if record else None)


def distcp(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


def overwrite_middle(file: Path, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(data)


# ----------------------------------------------------------------------------- checksums


def test_checksums_are_those_of_the_bytes_on_disk(tmp_path):
    step = save_model(tmp_path / "step-1")
    files = checkpoint.saved_files(step)
    assert set(files) == {distcp(step).name, ".metadata"}
    for name, (crc, size) in files.items():
        data = (step / name).read_bytes()
        assert (zlib.crc32(data), len(data)) == (crc, size)
    assert not list(step.glob("*.checksums.json*"))  # folded into the marker


def test_damage_of_equal_size_is_found_by_full_verification_only(tmp_path):
    step = save_model(tmp_path / "step-1")
    assert folder_problem(step, "full") is None
    overwrite_middle(distcp(step), b"\xff" * 4096)
    why = folder_problem(step, "full")
    assert why and distcp(step).name in why and "checksum" in why
    assert folder_problem(step, "fast") is None  # sizes only, as documented
    assert folder_problem(step, "off") is None


def test_fast_verification_catches_another_size_and_a_broken_marker(tmp_path):
    step = save_model(tmp_path / "step-1")
    with open(distcp(step), "ab") as f:
        f.write(b"x")
    assert "bytes" in folder_problem(step, "fast") and distcp(step).name in folder_problem(step)
    (step / checkpoint.COMPLETE_MARKER).write_text("{not json")
    assert "unreadable completion marker" in folder_problem(step, "off")


def test_resume_falls_back_past_a_damaged_folder_naming_the_file(tmp_path):
    save_model(tmp_path / "step-2", seed=2)
    newest = save_model(tmp_path / "step-4", seed=4)
    overwrite_middle(distcp(newest), bytes(range(256)) * 16)
    warnings = []
    got = resume_candidate(tmp_path, -1, lambda p: folder_problem(p, "full"), warnings.append)
    assert got.name == "step-2"
    assert len(warnings) == 1 and "step-4" in warnings[0] and distcp(newest).name in warnings[0]
    overwrite_middle(distcp(tmp_path / "step-2"), b"\0" * 4096)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        resume_candidate(tmp_path, -1, lambda p: folder_problem(p, "full"))


def test_load_step_names_the_steps_there_are(tmp_path):
    save_model(tmp_path / "step-2")
    with pytest.raises(CheckpointError) as e:
        resume_candidate(tmp_path, 7, folder_problem)
    assert "checkpoint.load_step = 7" in str(e.value) and "step-2" in str(e.value)


# ----------------------------------------------------------------------------- identity


def test_another_flavor_is_named_field_by_field(tmp_path):
    step = save_model(tmp_path / "step-1", "debugmodel")
    tied, _ = identity("debugmodel_tied")
    why = tied.problem(step)
    assert "tie_word_embeddings False (checkpoint) vs True (this run)" in why
    assert identity("debugmodel")[0].problem(step) is None


def test_rope_changes_load_only_when_asked(tmp_path):
    """A long-context phase changes RoPE's settings: refused by default with the flag named,
    allowed with checkpoint.allow_rope_change, and any other difference still refused."""
    step = save_model(tmp_path / "step-1", "debugmodel")
    _, args = identity()
    stretched = args.with_updates(rope_scaling_factor=8.0, rope_theta=1e6)
    ident = model_identity(LLAMA, "debugmodel", stretched)
    why = ident.problem(step)
    assert "rope_scaling_factor None (checkpoint) vs 8.0 (this run)" in why
    assert "--checkpoint.allow_rope_change" in why
    assert ident.problem(step, allow_rope_change=True) is None
    other = model_identity(LLAMA, "debugmodel", stretched.with_updates(norm_eps=1e-6))
    why = other.problem(step, allow_rope_change=True)
    assert "norm_eps" in why and "rope" not in why and "allow_rope_change" not in why
    assert "allow_rope_change" not in other.problem(step)  # not a RoPE change alone


def test_without_a_record_names_and_shapes_decide(tmp_path):
    """Saves from before the record: an untied model's output matrix differs from its
    embedding and is refused by a tied model; the former tied format (the pair stored equal)
    loads; another width is refused by its shapes."""
    untied = save_model(tmp_path / "untied", "debugmodel", record=False)
    former_tied = save_model(tmp_path / "tied", "debugmodel_tied", tie_copy=True, record=False)
    tied, _ = identity("debugmodel_tied")
    assert "output.weight apart from tok_embeddings.weight" in tied.problem(untied)
    assert tied.problem(former_tied) is None
    wide = model_identity(
        LLAMA, "debugmodel", LLAMA.flavors["debugmodel"].with_updates(vocab_size=2048, dim=512)
    )
    assert "shapes differ" in wide.problem(untied)


@pytest.fixture
def run_dir(tmp_path):
    """A dump folder whose checkpoint folder holds a debugmodel save at step 2."""
    save_model(tmp_path / "checkpoint" / "step-2")
    return tmp_path


def launcher_check(*argv):
    from titan.assembly.checkpoint_check import check_checkpoints

    job = parse_args(list(argv))
    check_checkpoints(job, plan_run(job, world_size=1))


def test_launcher_refuses_a_resume_of_another_model(run_dir):
    with pytest.raises(ConfigError) as e:
        launcher_check(
            "--checkpoint.enable",
            "--job.dump_folder",
            str(run_dir),
            "--model.flavor",
            "debugmodel_tied",
        )
    msg = str(e.value)
    assert "cannot resume from" in msg and "tie_word_embeddings" in msg and "model.flavor" in msg
    launcher_check("--checkpoint.enable", "--job.dump_folder", str(run_dir))  # the same: fine


def test_launcher_refuses_an_initial_load_of_another_model(run_dir, tmp_path_factory):
    fresh = tmp_path_factory.mktemp("fresh")
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path .*tie_word_embeddings"):
        launcher_check(
            "--checkpoint.initial_load_path",
            str(run_dir / "checkpoint" / "step-2"),
            "--model.flavor",
            "debugmodel_tied",
            "--job.dump_folder",
            str(fresh),
        )


def test_launcher_refuses_a_missing_load_step_and_no_usable_checkpoint(run_dir):
    base = ["--checkpoint.enable", "--job.dump_folder", str(run_dir)]
    with pytest.raises(ConfigError, match="load_step = 9.*step-2"):
        launcher_check(*base, "--checkpoint.load_step", "9")
    with open(distcp(run_dir / "checkpoint" / "step-2"), "ab") as f:
        f.write(b"xx")
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        launcher_check(*base)


def test_launcher_refuses_a_disk_that_cannot_hold_a_save(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: usage(10**12, 0, 2**20))
    with pytest.raises(ConfigError) as e:
        launcher_check("--checkpoint.enable", "--job.dump_folder", str(tmp_path))
    # the debug model: 6.6M parameters, float32 weights and two AdamW moments
    job = parse_args([])
    args = LLAMA.flavors["debugmodel"].with_updates(vocab_size=2048)
    need = disk_space.model_save_bytes(LLAMA.build_meta(args), job.optimizer, job.extensions)
    # float32 weights, two float32 moments and a step count per tensor
    n, tensors = args.num_params(), len(list(LLAMA.build_meta(args).parameters()))
    assert need == int((12 * n + 4 * tensors) * disk_space.OVERHEAD_FACTOR) + (
        disk_space.OVERHEAD_BYTES
    )
    assert f"needs {need / 2**30:.2f} GiB" in str(e.value) and "0.00 GiB free" in str(e.value)
    launcher_check("--job.dump_folder", str(tmp_path))  # no checkpoints: no space needed


# ----------------------------------------------------------------------------- failed saves


def test_a_write_failure_is_told_in_a_few_words():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
        wrapped = CheckpointException("write", {1: _wrap_exception(e)})
    assert _write_failure(wrapped) == "the disk is full (no space left on device)"
    assert _write_failure(OSError(errno.EIO, "I/O error")) == "an I/O error on the disk (EIO)"
    assert _write_failure(RuntimeError("boom\nmore")) == "RuntimeError: boom"


def test_only_what_a_restart_would_meet_again_is_a_checkpoint_error():
    """A full disk or a folder it may not write stops the job (exit 2); a peer that died
    mid-save (gloo: 'Connection closed by peer') or an I/O error is a rank failure, which
    torchrun restarts."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from titan.components.checkpoint.checkpointer import _deterministic

    def wrapped(err):
        try:
            raise err
        except Exception as e:  # noqa: BLE001
            return CheckpointException("write", {1: _wrap_exception(e)})

    for err in (
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.EROFS, "Read-only file system"),
    ):
        assert _deterministic(err) and _deterministic(wrapped(err)), err
    peer = RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:28833. This is typically caused by a remote worker crashing"
    )
    for err in (peer, OSError(errno.EIO, "I/O error"), TimeoutError("timed out")):
        assert not _deterministic(err) and not _deterministic(wrapped(err)), err


def _failing_save(rank, world_size, root):
    from titan.components.checkpoint import checkpointer
    from titan.components.checkpoint.train_state import TrainState

    def no_space(*args, **kwargs):
        # as DCP reports it: each rank's error in a CheckpointException, a BaseException
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise CheckpointException("write", {0: _wrap_exception(e)}) from None

    cfg = parse_args([]).checkpoint
    cfg.enable = True
    ck = checkpointer.Checkpointer(
        cfg, dump_folder=root, rank=rank, states={"train_state": TrainState()}
    )
    ck.save(2)
    checkpointer.dcp.save = no_space
    try:
        ck.save(4)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_a_save_that_fails_leaves_no_folder_and_keeps_the_last(tmp_path):
    from tests.forked import run_workers

    msg = run_workers(_failing_save, 1, tmp_path, str(tmp_path / "dump"))[0]
    root = tmp_path / "dump" / "checkpoint"
    assert msg and "disk is full" in msg and "step-2 is the newest complete checkpoint" in msg
    assert [p.name for p in root.iterdir()] == ["step-2"]
    assert folder_problem(root / "step-2", "full") is None
    assert json.loads((root / "step-2" / ".complete").read_text())["step"] == 2


def _threaded_save(rank, world_size, root):
    from titan.components.checkpoint import checkpointer
    from titan.components.checkpoint.train_state import ModelState, TrainState

    cfg = parse_args([]).checkpoint
    cfg.enable = True
    torch.manual_seed(0)  # replicated, as a model is without sharding
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    states = {"model": ModelState([model]), "train_state": TrainState()}
    ck = checkpointer.Checkpointer(cfg, dump_folder=root, rank=rank, states=states)
    ck.save(1)
    ck.close()
    torch.distributed.barrier()  # rank 0 marks the folder complete after the others wrote
    for p in model.parameters():
        p.data.zero_()
    checkpointer.Checkpointer(cfg, dump_folder=root, rank=rank, states=states).load()
    return all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())


def test_a_save_writes_each_rank_s_files_on_write_threads_each_checksummed(tmp_path):
    """checkpoint.write_threads (2 by default) files per rank, written at once; the marker
    checksums every one of them, and the state loads back as saved on both ranks."""
    from tests.forked import run_workers

    assert all(run_workers(_threaded_save, 2, tmp_path, str(tmp_path / "dump")))
    step = tmp_path / "dump" / "checkpoint" / "step-1"
    files = checkpoint.saved_files(step)
    names = {p.name for p in step.glob("*.distcp")}
    assert {"__0_0.distcp", "__0_1.distcp"} <= names  # rank 0's share, in two files
    assert set(files) == names | {".metadata"}
    assert folder_problem(step, "full") is None


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3"])
def test_every_flavor_comes_back_from_its_record(family):
    """convert_to_hf and generate read a checkpoint's architecture from its marker's record
    (JSON): nested settings (an MoE's) come back as their dataclass, lists as tuples."""
    import json

    from titan.components.checkpoint.identity import args_in_record
    from titan.models.spec import get_train_spec

    spec = get_train_spec(family)
    for name, args in spec.flavors.items():
        record = json.loads(
            json.dumps({"args": model_identity(spec, name, args.with_updates(n_layers=1)).args})
        )
        back = args_in_record(spec, record, args.max_seq_len)
        assert back == args.with_updates(n_layers=1), name


def test_llama3_rope_options_override_the_flavor():
    job = parse_args(["--llama3.rope_scaling_factor", "8", "--llama3.rope_original_max_len", "64"])
    args = plan_run(job, world_size=1).model_args
    assert (args.rope_scaling_factor, args.rope_original_max_len) == (8.0, 64)
    assert args.rope_theta == LLAMA.flavors["debugmodel"].rope_theta  # unset: the flavor's
