"""Saving and restoring a training run: DCP saves (sync or async), resume from the newest
usable checkpoint, initial loads, retention. Folder rules live in `folders.py`.

Async saves hand the state to DCP's saving process through shared memory: the copy runs
during the next step's forward/backward, and the optimizer step waits for it.
"""

import contextlib
import errno
import logging
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from titan.components.checkpoint.disk_space import OVERHEAD_BYTES, OVERHEAD_FACTOR, space_problem
from titan.components.checkpoint.folders import (
    COMPLETE_MARKER,
    CheckpointError,
    folder_problem,
    resume_candidate,
    saved_files,
    saved_keys,
    saved_layout,
    saved_model_only,
    set_aside_newer,
    step_folder,
    step_folders,
    write_complete_marker,
)
from titan.components.checkpoint.identity import INITIAL_LOAD_FIX, RESUME_FIX, refusal
from titan.components.checkpoint.integrity import (
    checksumming_writer,
    collect_sidecars,
    file_problem,
    remove_sidecars,
)
from titan.components.checkpoint.storage import (
    checkpoint_root,
    dcp_reader,
    is_remote,
    make_folder,
    remove_tree,
)
from titan.components.checkpoint.trained_with import resume_problem, tokenizer_problem
from titan.runtime.dtypes import to_dtype
from titan.runtime.paths import resolve

logger = logging.getLogger(__name__)

STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


def local_state_bytes(obj) -> int:
    """Bytes this rank holds of a (nested) state dict: DTensors count their local shard."""
    if isinstance(obj, dict):
        return sum(local_state_bytes(v) for v in obj.values())
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


def _shm_fits(state: dict) -> bool:
    """Whether every node's /dev/shm holds its ranks' staged copies; the same answer on all
    ranks (a save is collective). Asked once: later saves reuse the staging buffers."""
    need = local_state_bytes(state) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = None
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    fits = torch.tensor(int(free is None or need <= free))
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if not fits:
        logger.warning(
            "async checkpointing stages %.2f GiB per node in /dev/shm%s; saving synchronously "
            "instead. Enlarge /dev/shm (e.g. docker run --shm-size) or set "
            "checkpoint.async_mode = 'disabled'",
            need / 2**30,
            f" but only {free / 2**30:.2f} GiB are free"
            if free is not None and need > free
            else " but another node lacks the space",
        )
    return bool(fits)


@contextlib.contextmanager
def _children_ignore_ctrl_c(starting: bool):
    """Within, processes started (DCP's saving process, on the first async save: `starting`)
    ignore SIGINT: Ctrl-C reaches the terminal's whole process group, and the trainer, not
    its helper, decides how to stop (the helper is killed then; its save stays incomplete)."""
    if not starting or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited across exec
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _save_process():
    from torch.distributed.checkpoint import _async_process_executor as executor

    return getattr(executor, "_CHECKPOINT_PROCESS", None)


def stop_save_process(kill: bool = False) -> None:
    """Ask DCP's saving process to exit now: left to interpreter shutdown, it sees its pipe
    close and dies printing an EOFError traceback after every async run. `kill`: at once,
    a save in flight left incomplete (a run being stopped)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = _save_process()
    if proc is None:
        return
    executor._CHECKPOINT_PROCESS = None
    if kill:
        child = getattr(proc, "_save_process", None)
        if child is not None and child.is_alive():
            child.kill()
        return
    proc.__del__()  # sends TERMINATE and joins; a later call is a no-op


# what a restart would meet again: the disk, its permissions
_DETERMINISTIC_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


class SaveInterrupted(RuntimeError):
    """A save that a rank's failure broke (a peer died or lost its connection mid-save): a
    rank failure, which torchrun restarts (MAX_RESTARTS), not a checkpoint error."""


def _writer_thread_failed(args) -> None:
    logger.debug("a checkpoint writer thread failed: %r", args.exc_value)


def _chain(e: BaseException):
    """`e` and every exception beneath it: causes, contexts, DCP's per-rank failures."""
    seen, todo = set(), [e]
    while todo:
        err = todo.pop()
        if id(err) in seen or not isinstance(err, BaseException):
            continue
        seen.add(id(err))
        yield err
        for failure in (getattr(err, "failures", None) or {}).values():
            # DCP's per-rank failures are (exception, stack) pairs
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [x for x in (err.__cause__, err.__context__) if x is not None]


def _says_disk_full(e: BaseException) -> bool:
    """A full disk that DCP reports only in its message."""
    return "No space left on device" in str(e) or "unexpected pos" in str(e)


def _deterministic(e: BaseException) -> bool:
    """Whether a failed save would fail again after a restart (the disk is full, a folder is
    not writable), rather than because a rank or its connection failed."""
    return any(
        isinstance(err, OSError) and err.errno in _DETERMINISTIC_ERRNOS for err in _chain(e)
    ) or _says_disk_full(e)


def _write_failure(e: BaseException) -> str:
    """The reason a save failed, in a few words: the OSError beneath DCP's wrapping."""
    for err in _chain(e):
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return "the disk is full (no space left on device)"
        if isinstance(err, OSError) and err.errno == errno.EIO:
            return "an I/O error on the disk (EIO)"
        if isinstance(err, OSError) and err.errno in _DETERMINISTIC_ERRNOS:
            return f"{err.strerror or type(err).__name__} ({err.filename or 'the folder'})"
    text = str(e)
    if _says_disk_full(e):
        return "the disk is full (no space left on device)"
    return f"{type(e).__name__}: {text.strip().splitlines()[0][:300] if text.strip() else ''}"


class Checkpointer:
    """Saves and restores `states` (STATE_KEYS -> Stateful) as configured by `cfg`, the
    checkpoint section.

    `layout` describes the parallel layout, recorded with each save and compared on resume.
    `identity` (an `identity.ModelIdentity`) is the model: recorded with each save,
    and a checkpoint of another model is refused before anything is loaded. `save_bytes`
    estimates a full save before there is one to measure (0: no space check). `hf` (an
    `hf_io.HFModelIO`) reads and writes HF folders through the model's adapter, for
    `initial_load_in_hf` and `last_save_in_hf`. `on_save_phase(phase, step)` (the fault
    injector's hook) runs as a synchronous save starts writing this rank's files ("writing")
    and once a save's files are written, before it is marked complete ("written").
    `on_export(folder)` runs on every rank once a final model-only save is written into
    `folder`, before it is marked complete (LoRA writes its PEFT adapter there).
    `trained_with` (`trained_with.trained_with`: optimizer, tokenizer) is recorded with each
    save, and a resume onto another is refused.
    """

    def __init__(
        self,
        cfg,
        *,
        dump_folder: str,
        states: dict,
        rank: int,
        layout: dict | None = None,
        identity=None,
        save_bytes: int = 0,
        hf=None,
        on_save_phase: Callable[[str, int], None] | None = None,
        on_export: Callable[[Path], None] | None = None,
        trained_with: dict | None = None,
    ):
        self.cfg = cfg
        self.root = checkpoint_root(dump_folder, cfg.folder)
        # where an HF export into object storage is assembled before its upload
        self.staging = Path(dump_folder) / ".hf_export"
        self.states = states
        self.rank = rank
        self.layout = layout
        self.identity = identity
        self.save_bytes = save_bytes
        self.hf = hf
        self.on_save_phase = on_save_phase
        self.on_export = on_export
        self.trained_with = trained_with
        self._pending = None  # (upload future, path, step) of an async save in flight
        self._staging = None  # (staging future, step) while its copy may still be running
        self._async_stager = None
        self._shm_ok: bool | None = None  # whether staging fits in /dev/shm (checked once)
        self._purge_queue: queue.Queue = queue.Queue()
        # where this run moved another history's steps at its start (None: nothing)
        self.set_aside: Path | None = None
        self._purger = None
        if cfg.enable and rank == 0 and cfg.keep_latest_k > 0:
            self._purger = threading.Thread(target=self._purge_loop, daemon=True)
            self._purger.start()

    # ------------------------------------------------------------------ load

    def _problem(self, path: Path) -> str | None:
        """folder_problem under checkpoint.verify; "full" reads the checksummed files once in
        all, each rank its share, and every rank gets the same answer."""
        verify = self.cfg.verify
        why = folder_problem(path, "off" if verify == "off" else "fast")
        if why or verify != "full":
            return why
        files = sorted((saved_files(path) or {}).items())
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        t0 = time.perf_counter()
        mine = next(
            (
                w
                for name, expected in files[rank::world]
                if (w := file_problem(path, name, expected, full=True))
            ),
            None,
        )
        if distributed:
            found: list = [None] * world
            dist.all_gather_object(found, mine)
            mine = next((w for w in found if w), None)
        if mine is None and files:
            logger.info(
                "verified the checksums of %s's %d files in %.2fs",
                path.name,
                len(files),
                time.perf_counter() - t0,
            )
        return mine

    def _check_identity(self, path: Path, what: str, fix: str, base: bool = False) -> None:
        why = (
            self.identity.problem(path, self.cfg.allow_rope_change, base=base)
            if self.identity is not None
            else None
        )
        if why:
            raise CheckpointError(refusal(what, path, why, fix))

    def load(self) -> bool:
        """Restore from the newest usable checkpoint, else load the initial load path; True if
        the training state (not only the model) was restored."""
        if not self.cfg.enable:
            return self._initial_load()  # nothing to resume from without checkpointing
        path = resume_candidate(self.root, self.cfg.load_step, self._problem, warn=logger.warning)
        self.set_aside = set_aside_newer(self.root, path, self._problem, self.rank)
        if path is None:
            return self._initial_load()
        why = tokenizer_problem(path, self.trained_with or {})  # before the vocabulary's size
        if why:
            raise CheckpointError(f"cannot resume from {path}: {why}")
        self._check_identity(path, "cannot resume from", RESUME_FIX)
        why = resume_problem(path, self.trained_with or {}, self.cfg.exclude_from_loading)
        if why:
            raise CheckpointError(f"cannot resume from {path}: {why}")
        if self.states["model"].partial:
            # the checkpoint holds what training changed (adapters); the rest is the base
            self._initial_load()
        keys = [k for k in STATE_KEYS if k not in self.cfg.exclude_from_loading]
        present = saved_keys(path)
        absent = [k for k in keys if k not in present]
        if absent:
            logger.info(
                "checkpoint %s holds no %s (model-only save): those start fresh",
                path.name,
                ", ".join(absent),
            )
        self._dcp_load({k: self.states[k] for k in keys if k in present}, path)
        logger.info("resumed from %s at step %d", path, self.states["train_state"].step)
        saved = saved_layout(path)
        # keys a layout record holds since they were added (an older one lacks the batch size)
        changed = {
            k: (saved[k], v)
            for k, v in (self.layout or {}).items()
            if saved is not None and k in saved and saved[k] != v
        }
        if changed:
            batch = changed.get("global_batch_size")
            data = (
                f"the data continues at the first sequence not yet trained, in global "
                f"batches of {batch[1]} sequences instead of {batch[0]}"
                if batch
                else "the data continues at the same global batch"
            )
            logger.warning(
                "layout change: %s was saved on another parallel layout (%s); its "
                "states were resharded and %s",
                path.name,
                ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
                data,
            )
        return True

    def _dcp_load(self, state: dict, path: Path) -> None:
        t0 = time.perf_counter()
        md = dcp_reader(path).read_metadata().state_dict_metadata
        if "train_state" in state:
            state["train_state"].saved_keys = {
                k.split(".", 1)[1] for k in md if k.startswith("train_state.")
            }
        if "dataloader" in state:
            data = state["dataloader"]
            data.load_sizes = {
                k.split(".", 1)[1]: m.size[0] for k, m in md.items() if k.startswith("dataloader.")
            }
            saved = sorted(data.load_sizes)
            ranks = [k for k in saved if k.startswith("dp_rank_")]
            if data.key not in data.load_sizes or (ranks and len(ranks) != data.dp_world_size):
                raise CheckpointError(
                    f"{path} holds the data positions {saved}, and this run needs {data.key} "
                    f"of {data.dp_world_size} dp ranks: a stream read in 'rank' order is saved "
                    "per dp rank and resumes only on the same data-parallel degree. Train with "
                    'training.dataset_stream_order = "global" to resume on any degree, or '
                    'set checkpoint.exclude_from_loading = ["dataloader"] to restart the data'
                )
        try:
            dcp.load(
                state,
                storage_reader=dcp_reader(path),
                planner=DefaultLoadPlanner(allow_partial_load=False),
            )
        finally:
            if "dataloader" in state:
                state["dataloader"].load_sizes = {}
            if "train_state" in state:
                state["train_state"].saved_keys = None
        logger.info("loaded %s from %s in %.2fs", ", ".join(state), path, time.perf_counter() - t0)

    def _initial_load(self) -> bool:
        """Load checkpoint.initial_load_path (only the base model's part of the state when
        training changes only part of it, as LoRA does)."""
        cfg = self.cfg
        if not cfg.initial_load_path:
            return False
        path = resolve(cfg.initial_load_path)
        t0 = time.perf_counter()
        if cfg.initial_load_in_hf:
            if self.hf is None:
                raise CheckpointError(
                    "checkpoint.initial_load_in_hf: this model family has no HF state-dict adapter"
                )
            model = self.states["model"].base()
            if is_remote(path):
                path = self._local_hf_copy(path)
            state, nbytes = self.hf.load_into(model.state_dict(), path)
            model.load_state_dict(state)
            logger.info(
                "initialized the model from the HF weights in %s: %d tensors, %.1f MiB "
                "read by this rank (its shards only) in %.2fs",
                path,
                len(state),
                nbytes / 2**20,
                time.perf_counter() - t0,
            )
            return False
        why = self._problem(path) if path.is_dir() else "does not exist"
        if why:
            raise CheckpointError(f"checkpoint.initial_load_path {path}: {why}")
        self._check_identity(path, "checkpoint.initial_load_path", INITIAL_LOAD_FIX, base=True)
        model_only = cfg.initial_load_model_only or self.states["model"].partial
        keys = (
            ["model"]
            if model_only
            else [
                k for k in STATE_KEYS if k not in cfg.exclude_from_loading and k in saved_keys(path)
            ]
        )
        states = {**self.states, "model": self.states["model"].base()}
        self._dcp_load({k: states[k] for k in keys}, path)
        logger.info("initialized %s from the checkpoint %s", ", ".join(keys), path)
        return not model_only

    # ------------------------------------------------------------------ save

    def due(self, step: int, last: bool) -> bool:
        c = self.cfg
        return c.enable and (
            step % c.interval == 0 or last or (step == 1 and c.enable_first_step_checkpoint)
        )

    def save(self, step: int, model_only: bool = False, blocking: bool = False) -> float:
        """Save `step`; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        if model_only:
            # an export (final save) in export_dtype; a seed checkpoint (step 0) as initialized
            dtype = to_dtype(self.cfg.export_dtype) if step > 0 else None
            state = {"model": self.states["model"].exported(dtype, folded=step > 0)}
        else:
            state = dict(self.states)
        path = step_folder(self.root, step)
        self._check_space(path, model_only, getattr(state.get("model"), "export_dtype", None))
        if self.rank == 0:
            remove_tree(path)  # a re-run of a step rewrites it whole
            make_folder(path)
        dist.barrier()
        if model_only and step > 0 and self.cfg.last_save_in_hf:
            # DCP's assembly of the safetensors files reads and writes local files: into a
            # bucket, the folder is assembled under the dump folder, then uploaded
            local = self.staging / path.name if is_remote(path) else path
            with self._writing(path, step):
                self.hf.save(
                    state["model"].state_dict(),
                    local,
                    state["model"].export_dtype,
                    self.cfg.hf_max_shard_size,
                )
                if self.on_export is not None:
                    self.on_export(local)
                if local != path:
                    self._upload(local, path)
            self._phase("written", step)
            self._mark_complete(path, step, model_only, fmt="hf", folded=state["model"].folded)
            blocked = time.perf_counter() - t0
            logger.info("checkpoint step %d saved as an HF folder %s in %.2fs", step, path, blocked)
            return blocked
        run_async = self.cfg.async_mode != "disabled" and not blocking
        if run_async:
            # plain tensors from here on: the size check and the stager see the same dict
            state = {k: v.state_dict() for k, v in state.items()}
            if self._shm_ok is None:
                self._shm_ok = _shm_fits(state)
            run_async = self._shm_ok
        if run_async:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if torch.cuda.is_initialized():
                # the stager copies on its own stream, which does not wait for the optimizer step
                torch.cuda.current_stream().synchronize()
            # state_dict() runs here (FSDP's must stay on this thread); the copy into shared
            # memory runs on the stager's thread while the next forward/backward does
            with _children_ignore_ctrl_c(starting=_save_process() is None):
                response = dcp.async_save(
                    state,
                    checkpoint_id=str(path),
                    async_stager=self._stager(),
                    storage_writer=checksumming_writer(path, thread_count=self.cfg.write_threads),
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
            self._pending = (response.upload_completion, path, step)
            self._staging = (response.staging_completion, step)
        else:
            writer = checksumming_writer(
                path,
                on_write=lambda: self._phase("writing", step),
                thread_count=self.cfg.write_threads,
            )
            with self._writing(path, step):
                dcp.save(state, checkpoint_id=str(path), storage_writer=writer)
            self._phase("written", step)
            self._mark_complete(path, step, model_only, folded=model_only and state["model"].folded)
        blocked = time.perf_counter() - t0
        logger.info(
            "checkpoint step %d %s (%s, training blocked %.2fs)",
            step,
            "staging" if run_async else "saved",
            "async" if run_async else "sync",
            blocked,
        )
        return blocked

    def _local_hf_copy(self, url: Path) -> Path:
        """An HF folder in a bucket, copied into the local cache by one rank of each node
        (the others wait, then find it there)."""
        from titan.components.checkpoint.hf_io import local_hf_copy

        t0 = time.perf_counter()
        first = int(os.environ.get("LOCAL_RANK", "0")) == 0
        if first:
            local = local_hf_copy(url)
            logger.info("copied %s to %s in %.2fs", url, local, time.perf_counter() - t0)
        if dist.is_initialized():
            dist.barrier()
        return local if first else local_hf_copy(url)

    def _upload(self, local: Path, path: Path) -> None:
        """Every file of the assembled folder `local` into `path` (each rank its share), then
        the local copy removed; the marker comes after, as for any save."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        files = sorted(f for f in local.iterdir() if f.is_file())
        for f in files[self.rank :: world]:
            (path / f.name).fs.put_file(str(f), (path / f.name).path)
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            remove_tree(local)
        logger.info("uploaded the HF export (%d files) to %s", len(files), path)

    def _needed_bytes(self, model_only: bool, export_dtype: torch.dtype | None) -> int:
        """What the save will write: the newest complete save's size when there is one of the
        same kind, else the estimate (a model-only save: the weights in its dtype)."""
        if model_only:
            elements = (
                sum(math.prod(s) for s in self.identity.shapes.values())
                if self.identity is not None
                else 0
            )
            itemsize = (export_dtype or torch.float32).itemsize
            return int(elements * itemsize * OVERHEAD_FACTOR) + OVERHEAD_BYTES
        for _, folder in reversed(step_folders(self.root) if self.root.is_dir() else []):
            files = saved_files(folder)
            if files and not saved_model_only(folder):
                return (
                    int(sum(size for _, size in files.values()) * OVERHEAD_FACTOR) + OVERHEAD_BYTES
                )
        return self.save_bytes

    def _check_space(self, path: Path, model_only: bool, export_dtype) -> None:
        """Refuse a save the disk cannot hold, before a byte of it is written; every rank
        gets rank 0's answer (a save is collective)."""
        why = None
        if self.rank == 0 and (need := self._needed_bytes(model_only, export_dtype)):
            why = space_problem(self.root, need)
        box = [why]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise CheckpointError(f"{path.name} not saved: {box[0]}; then resume")

    @contextlib.contextmanager
    def _writing(self, path: Path, step: int):
        """A save that fails part-way leaves no folder behind; the newest complete checkpoint
        stays as it was. A full disk or a folder it may not write is one line that says why
        (a checkpoint error: a restart would fail alike); anything else (a rank that died
        mid-save, an I/O error) is a rank failure, which torchrun restarts to resume."""
        # DCP's writer threads would each print their traceback of the same failure first
        hook, threading.excepthook = threading.excepthook, _writer_thread_failed
        try:
            yield
        # DCP wraps each rank's OSError its own way, in a CheckpointException: a BaseException
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            if self.rank == 0:
                remove_tree(path)
            kept = next(
                (
                    p.name
                    for _, p in reversed(step_folders(self.root))
                    if p != path and (p / COMPLETE_MARKER).is_file()
                ),
                None,
            )
            if not _deterministic(e):
                raise SaveInterrupted(
                    f"checkpoint step {step} was not written: {_write_failure(e)}; the partial "
                    "folder was removed, "
                    + (
                        f"{kept} is the newest complete checkpoint"
                        if kept
                        else "there is no earlier checkpoint"
                    )
                ) from e
            raise CheckpointError(
                f"checkpoint step {step} could not be written to {path}: {_write_failure(e)}. "
                "The partial folder was removed; "
                + (
                    f"{kept} is the newest complete checkpoint and is kept"
                    if kept
                    else "there is no earlier checkpoint"
                )
                + f". Free space under {self.root} (or point job.dump_folder at another disk) "
                "and resume"
            ) from None
        finally:
            threading.excepthook = hook

    def _stager(self):
        """One stager per run: its staging buffers are reused by every save, so only the first
        save pays for allocating (and pinning) them."""
        if self._async_stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            class KeptStager(DefaultStager):
                # torch 2.11's async_save closes the stager it is given once a save is
                # uploaded (later versions close only their own), which broke the next save
                # with "KeyError: <class 'type'>": titan closes it itself, in close()
                def close(self) -> None:
                    pass

                def release(self) -> None:
                    DefaultStager.close(self)

            pinned = self.cfg.async_mode == "async_with_pinned_mem"
            # shared memory hands the staged copy to the saving process without pickling it
            self._async_stager = KeptStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=True,
                    use_async_staging=True,
                    use_non_blocking_copy=pinned,
                )
            )
        return self._async_stager

    def wait_for_staging(self) -> float:
        """Block until an async save has copied what it saves; returns the seconds waited.

        Call before anything changes saved tensors in place (the optimizer step, a torchft
        heal): until then the copy still reads the live parameters and optimizer state.
        """
        if self._staging is None:
            return 0.0
        t0 = time.perf_counter()
        future, step = self._staging
        self._staging = None
        future.result()
        waited = time.perf_counter() - t0
        logger.info("checkpoint step %d staged; training waited %.2fs for the copy", step, waited)
        return waited

    def _phase(self, phase: str, step: int) -> None:
        if self.on_save_phase is not None:
            self.on_save_phase(phase, step)

    def wait(self) -> None:
        """Finish an async save in flight and mark it complete."""
        if self._pending is None:
            return
        self.wait_for_staging()
        future, path, step = self._pending
        self._pending = None
        with self._writing(path, step):
            future.result()
        self._phase("written", step)
        self._mark_complete(path, step, model_only=False)

    def _mark_complete(
        self, path: Path, step: int, model_only: bool, fmt: str = "dcp", folded: bool = False
    ) -> None:
        """`folded`: the weights hold the run-time multipliers (an export): the plain model
        computes what the run did, so the marker records no parametrization."""
        # every rank's writes and the metadata are done when dcp.save / the future returns
        if self.rank != 0:
            return
        trained_with = self.trained_with
        if folded and trained_with:
            trained_with = {**trained_with, "parametrization": {}}
        files = collect_sidecars(path)
        write_complete_marker(
            path,
            step,
            model_only,
            self.layout,
            fmt,
            model=self.identity.record() if self.identity else None,
            files=files or None,
            trained_with=trained_with,
        )
        remove_sidecars(path)
        if self._purger is not None:
            self._purge_queue.put(step)

    def _purge_loop(self) -> None:
        while True:
            newest = self._purge_queue.get()
            if newest is None:
                return
            steps = [(s, p) for s, p in step_folders(self.root) if s <= newest]
            complete = [(s, p) for s, p in steps if (p / COMPLETE_MARKER).is_file()]
            doomed = [p for _, p in complete[: -self.cfg.keep_latest_k]]
            # torn saves older than the newest complete one will never be completed
            doomed += [p for s, p in steps if s < newest and not (p / COMPLETE_MARKER).is_file()]
            for p in doomed:
                # the marker first: a removal cut short leaves no folder that claims to be whole
                (p / COMPLETE_MARKER).unlink(missing_ok=True)
                remove_tree(p)
                logger.info(
                    "removed old checkpoint %s (keep_latest_k=%d)", p.name, self.cfg.keep_latest_k
                )

    def close(self) -> None:
        self.wait()
        if self._async_stager is not None:
            self._async_stager.release()
            self._async_stager = None
            stop_save_process()
        if self._purger is not None:
            self._purge_queue.put(None)
            self._purger.join()
