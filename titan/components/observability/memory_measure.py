"""What a run holds per rank, measured on its real tensors at the first step, in the keys of
the memory planner (titan.planner.memory): `<dump_folder>/memory_measured.json`."""

import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from titan.components.training.callbacks import Callback


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_bytes(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer states (local shards; a
    parameter tied to another counts once)."""
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    opt_bytes = sum(
        tensor_bytes(v)
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "params_bytes": sum(tensor_bytes(p) for p in params),
        "grads_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": opt_bytes,
    }


def write_measured(path: Path, mine: dict, rank: int) -> dict:
    """Gather every rank's figures; rank 0 writes {"ranks": [...]}. Collective."""
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    record = {"ranks": ranks}
    if rank == 0:
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record


class ActivationTracker(TorchDispatchMode):
    """Peak bytes held for backward: every storage an op makes outside backward is watched
    through a weak reference, and the ones still alive are summed each time a backward
    begins (the moments after a forward, when held activations peak). This counts what
    saved-tensor hooks miss: selective AC's cache, checkpointed blocks' inputs, a pipeline's
    receive buffers and kept outputs. `held_elsewhere` names tensors a backward made that are
    held between a pipeline's actions (a zero-bubble input backward's gradients, kept for the
    weight backward), counted too; `measure` takes a reading where a backward start would
    miss them. Parameters and buffers (those there at the start, and FSDP's unsharded
    parameters) are not counted, though ops may return views of them.
    Eager mode only: compiled code allocates below the dispatcher."""

    def __init__(self, parts: list[nn.Module], held_elsewhere=None):
        super().__init__()
        self.parts = parts
        # tensors held between a pipeline's actions that backward made (the tracker watches
        # what ops make outside backward): a callable, counted at each measurement
        self.held_elsewhere = held_elsewhere
        self.watched: dict[int, StorageWeakRef] = {}
        self.peak = 0
        self._in_backward = False
        self._states = self._state_storages()

    def _state_storages(self) -> set[int]:
        """Parameters, buffers and the parameters' gradients (a pipeline's weight backward
        accumulates these outside autograd's graph task)."""
        return {
            s._cdata
            for part in self.parts
            for t in (
                *part.parameters(),
                *part.buffers(),
                *(p.grad for p in part.parameters() if p.grad is not None),
            )
            for s in storages(t)
        }

    def held_bytes(self, above: int = -1) -> int:
        """Bytes of the watched storages alive now. When they come to more than `above`,
        garbage is collected and they are counted again: reference cycles not yet collected
        (automatic GC is off while training) are no activations, and whether they were
        collected depended on the collector's counters, which a forked rank inherits (1.4x
        once on a CP rank). Collecting only then keeps a step that begins many backwards (96
        in a V schedule's first step, 0.14 s a collection) from paying for each."""
        total = self._alive_bytes()
        if total > above:
            gc.collect()
            total = self._alive_bytes()
        return total

    def _alive_bytes(self) -> int:
        params = self._states | self._state_storages()
        alive = {}
        for key, ref in list(self.watched.items()):
            if ref.expired():
                del self.watched[key]
            elif key not in params:
                alive[key] = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        for t in self.held_elsewhere() if self.held_elsewhere else ():
            for storage in storages(t):
                if storage._cdata not in params:
                    alive[storage._cdata] = storage.nbytes()
        return sum(alive.values())

    def measure(self) -> None:
        """Take the held bytes now into the peak."""
        self.peak = max(self.peak, self.held_bytes(above=self.peak))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        backward = torch._C._current_graph_task_id() != -1
        if backward and not self._in_backward:
            self.measure()
        self._in_backward = backward
        out = func(*args, **(kwargs or {}))
        if not backward:
            for t in tree_leaves(out):
                for storage in storages(t):
                    ref = self.watched.get(storage._cdata)
                    if ref is None or ref.expired():  # a freed storage's address is reused
                        self.watched[storage._cdata] = StorageWeakRef(storage)
        return out


def storages(t) -> list[torch.UntypedStorage]:
    """The storages that hold a tensor's data. A wrapper subclass (DTensor, an async
    collective's result, float8) reports a storage of its own size that holds nothing: its
    inner tensors are the ones that do."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in storages(getattr(t, name))]
    return [t.untyped_storage()]


class MemoryMeasured(Callback):
    """Writes `<dump_folder>/memory_measured.json` after the run's first step: the states'
    bytes and the activations the step held (measured by an ActivationTracker around it,
    except under torch.compile, whose kernels allocate below the dispatcher). The first
    step makes the optimizer states after its peak: on CUDA the peak allocation is written
    again after the second step, whose peak is the steady one."""

    def __init__(self):
        self.first = 1
        self.tracker: ActivationTracker | None = None
        self.measured: dict = {}

    def on_train_start(self, run) -> None:
        self.first = run.step + 1

    def around_step(self, run, step: int):
        if step != self.first or run.job.compile.enable:
            return None
        self.tracker = ActivationTracker(run.model_parts, run.held_between_actions)
        run.before_weight_backward(self.tracker.measure)
        return self.tracker

    def on_step_end(self, run, end) -> None:
        if end.step == self.first:
            run.before_weight_backward(None)
            self.measured = state_bytes(run.model_parts, run.optimizer.optimizers)
            if self.tracker is not None:
                self.measured["activations_bytes"] = self.tracker.peak
                self.tracker = None
        elif end.step != self.first + 1 or run.device.type != "cuda":
            return
        if run.device.type == "cuda":
            self.measured["max_memory_allocated"] = torch.cuda.max_memory_allocated(run.device)
            self.measured["max_memory_allocated_at_step"] = end.step
        write_measured(Path(run.dump_folder) / "memory_measured.json", self.measured, run.rank)


def build_callback(run, options) -> MemoryMeasured:
    return MemoryMeasured()
