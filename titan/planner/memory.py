"""Per-rank memory of a run, known before it starts: parameters, gradients and optimizer
states of every rank, from the model parts that rank would build (`titan.assembly.build.meta_parts`)
under a fake process group, so every sharding (FSDP's uneven last shards, TP's plans,
pipeline stages, tied copies) is torch's own and the bytes equal the run's; activations and
transient buffers from a forward of those parts on fake tensors (`titan.planner.activations`).

Keys match `<dump_folder>/memory_measured.json`, which the trainer writes at its first step.
"""

import contextlib
import copy
import dataclasses
import sys
import warnings

import torch
import torch.distributed as dist

from titan.components.optim.registry import optimizer_spec
from titan.components.optim.registry import state_bytes as optimizer_state_bytes
from titan.config import JobConfig
from titan.plan.run_plan import RunPlan


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A process group whose collectives do nothing: enough to build meshes and shard."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    chunk_with_empty = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _Chunks  # a world of any size plans in bounded time
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = chunk_with_empty
        dist.destroy_process_group()
        # DTensor caches sharding decisions by (equal) meshes: the next world's meshes would
        # get this world's, whose groups are gone
        _clear_sharding_prop_cache()


class _Chunks:
    """FSDP's `_chunk_with_empty(tensor, n, dim)`: torch.chunk's chunks padded with empty ones
    to n, the empty ones made when asked for. FSDP asks for two (its rank's and the first);
    the eager list of n would cost time and memory in proportion to the world size."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.real, self.n = torch.chunk(tensor, num_chunks, dim=dim), num_chunks

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        i = i + self.n if i < 0 else i
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.real[i] if i < len(self.real) else self.real[0].new_empty(0)


def state_bytes(parts: list, job: JobConfig) -> dict:
    """Parameters, gradients and optimizer states of one rank's (meta) parts, in bytes."""
    # here, not at the top: it imports DTensor, a second of the launcher's start-up that a
    # run with no device memory to check against (CPU) never needs
    from titan.components.observability.memory_measure import tensor_bytes
    from titan.config import extensions

    named = list({id(p): (n, p) for part in parts for n, p in part.named_parameters()}.values())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    spec = optimizer_spec(job.optimizer.name)
    copies = extensions.weight_copies(job.extensions)  # float32, sharded as the weights
    return {
        "params_bytes": sum(tensor_bytes(p) for _, p in named),
        "grads_bytes": sum(tensor_bytes(p) for _, p in trainable),
        "copies_bytes": copies * sum(4 * tensor_bytes(p) // p.element_size() for _, p in trainable),
        "optimizer_bytes": sum(
            optimizer_state_bytes(
                spec, n, p.shape, tensor_bytes(p) // p.element_size(), job.optimizer, job.extensions
            )
            for n, p in trainable
        ),
    }


def rank_bytes(job: JobConfig, plan: RunPlan, rank: int, worst_routing: bool = False) -> dict:
    """States, activations and transient buffers of one rank of the run `plan` (the job's
    plan_run), and their total, from one build of its parts. A forward the fake tensors
    cannot trace leaves activations and transients None, with the reason. `worst_routing`:
    under expert parallelism, also the bound for imbalanced routing (a second build and trace,
    which the launcher's check and --suggest do not need)."""
    return _rank_figures(job, plan, rank, worst_routing)[0]


def _total(out: dict) -> int:
    return out["states_bytes"] + (out["activations_bytes"] or 0) + (out["transient_bytes"] or 0)


def _rank_figures(job: JobConfig, plan: RunPlan, rank: int, worst_routing: bool = False):
    """(rank_bytes, what its pipeline stages hold: `activations.PipelineHeld`, or None)."""
    from titan.assembly.build import meta_parts
    from titan.planner.activations import trace_activations

    job = copy.deepcopy(job)
    job.compile.enable = False  # no state changes; activations are traced eagerly
    # the mesh of this fake world is built on a copy: the caller's plan keeps none
    plan = dataclasses.replace(plan, dims=dataclasses.replace(plan.dims))
    with fake_world(plan.dims.world_size, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, about FSDP hooks and flattened dims
        plan.dims.build_mesh("cpu")
        _, parts, pp_plan = meta_parts(job, plan)
        out = state_bytes(parts, job)
        out["states_bytes"] = sum(out.values())
        held = None
        try:
            traced, held = trace_activations(job, plan, parts, pp_plan)
            out.update(traced)
        except Exception as e:  # noqa: BLE001  the states are still worth reporting
            out.update(
                activations_bytes=None, transient_bytes=None, activations_error=_first_line(e)
            )
        if worst_routing and plan.dims.ep_enabled and out["activations_bytes"] is not None:
            out.update(_worst_routing_bytes(job, plan))
    out["total_bytes"] = _total(out)
    if "worst_routing_bytes" in out:  # the bound on the total when routing is imbalanced
        out["worst_routing_bytes"] += out["states_bytes"]
    return out, held


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _worst_routing_bytes(job: JobConfig, plan: RunPlan) -> dict:
    """Activations and transients traced with each rank receiving every row of its ep group
    in every MoE layer; on parts of their own, as a traced forward leaves its parts holding
    what the tracker of another forward would count."""
    from titan.assembly.build import meta_parts
    from titan.parallelisms.expert_parallel import worst_case_routing
    from titan.planner.activations import trace_activations

    _, parts, pp_plan = meta_parts(job, plan)
    try:
        with worst_case_routing(parts):
            worst, _ = trace_activations(job, plan, parts, pp_plan, worst_routing=True)
    except Exception as e:  # noqa: BLE001  the balanced figures stand without the bound
        return {"worst_routing_error": _first_line(e)}
    return {
        "worst_routing_activations_bytes": worst["activations_bytes"],
        "worst_routing_bytes": worst["activations_bytes"] + worst["transient_bytes"],
    }


def pipeline_rank_bytes(
    job: JobConfig, plan: RunPlan, worst_routing: bool = False
) -> list[tuple[int, int, dict]]:
    """(rank, pp rank, rank_bytes) for the first rank of every pipeline rank: the others of a
    pipeline rank differ only by an uneven FSDP shard's few elements, the first holding the
    most. Pipeline ranks whose stages have the same structure (`stage_structures`) are built
    and traced once, so a 126-layer model on 16 stages builds a few, not 16; each walks its
    own schedule actions with those figures."""
    dims = plan.dims
    per_pp = dims.world_size // dims.pp
    if not dims.pp_enabled:
        return [(0, 0, rank_bytes(job, plan, 0, worst_routing))]
    done: dict[tuple, tuple] = {}
    out = []
    for pp_rank, key in enumerate(stage_structures(plan)):
        rank = pp_rank * per_pp
        if key not in done:
            done[key] = _rank_figures(job, plan, rank, worst_routing)
            figures = done[key][0]
        else:
            figures, held = dict(done[key][0]), done[key][1]
            if held is not None:  # traced: the same stages, this rank's order of actions
                figures["activations_bytes"] = held.activations_bytes(
                    pp_rank, plan.pipeline(pp_rank).stage_ids
                )
                figures["total_bytes"] = _total(figures)
        out.append((rank, pp_rank, figures))
    return out


def stage_structures(plan: RunPlan) -> list[tuple]:
    """Per pipeline rank, what its figures depend on besides its place in the schedule: for
    each of its stages, whether it is the first or the last, which top-level modules it holds
    (embedding, norm, output: a tied output has no parameter of its own), and its modules'
    types and parameters' shapes and dtypes, named with a block's index taken as its position
    in the stage (`layers.7` of a stage of layers 6-7 is `layers.1`), so equal layer counts
    of unlike blocks (a family whose first layers differ) do not match."""
    whole = plan.spec.build_meta(plan.model_args)
    out = []
    for pp_rank in range(plan.dims.pp):
        pp_plan = plan.pipeline(pp_rank)
        stages = []
        for sid in pp_plan.stage_ids:
            stage = plan.spec.pipelining_fn(whole, sid, pp_plan)
            rename = _block_positions(stage)
            stages.append(
                (
                    sid == 0,
                    sid == pp_plan.num_stages - 1,
                    tuple(name for name, _ in stage.named_children()),
                    tuple((rename(name), type(m).__name__) for name, m in stage.named_modules()),
                    tuple(
                        (rename(name), tuple(p.shape), p.dtype)
                        for name, p in stage.named_parameters(remove_duplicate=False)
                    ),
                )
            )
        out.append(tuple(stages))
    return out


def _block_positions(stage: torch.nn.Module):
    """A renaming of `stage`'s dotted names: a numbered child of a top-level module (a block
    of the stack) by its position among those the stage holds."""
    position = {}
    for top, child in stage.named_children():
        blocks = [name for name, _ in child.named_children() if name.isdigit()]
        position.update({(top, name): str(i) for i, name in enumerate(blocks)})

    def rename(dotted: str) -> str:
        parts = dotted.split(".")
        if len(parts) > 1 and (parts[0], parts[1]) in position:
            parts[1] = position[parts[0], parts[1]]
        return ".".join(parts)

    return rename


_FIXES = {
    "activations_bytes": 'checkpoint more (activation_checkpoint.mode = "selective" or '
    '"full"), lower training.local_batch_size (global_batch_size '
    "then accumulates gradients), or shard the sequence "
    "(parallelism.context_parallel_degree, tensor_parallel_degree)",
    "transient_bytes": "shard FSDP units over more ranks, or lower training.local_batch_size "
    "(the logits' gradient)",
    "params_bytes": "shard them over more ranks (parallelism.data_parallel_shard_degree, "
    "tensor_parallel_degree or pipeline_parallel_degree)",
    "grads_bytes": "shard them over more ranks (FSDP: parallelism.data_parallel_shard_degree)",
    "copies_bytes": "shard the weights over more ranks (parallelism.data_parallel_shard_degree), "
    "or keep no average of them (ema.enable = false)",
    "optimizer_bytes": 'keep Adam\'s moments in bf16 (optimizer.state_dtype = "bfloat16"), '
    "shard them over more ranks (parallelism.data_parallel_shard_degree), or "
    "offload them (training.enable_cpu_offload)",
}


def human_bytes(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.3f} GiB"
    # below 0.1 MiB the MiB figure would read 0.0 (a tiny model's activations)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n / 2**10:.1f} KiB"


def device_memory_bytes(job: JobConfig) -> int | None:
    """The memory one rank may use: stated, else the visible GPU's, else None (CPU)."""
    if job.memory.device_memory_gib > 0:
        return int(job.memory.device_memory_gib * 2**30)
    if job.training.device != "cpu" and torch.cuda.is_available():
        return _gpu_total_memory()
    return None


def _gpu_total_memory() -> int | None:
    """Asked in a child process: a CUDA context made here would stay on GPU 0 for the whole
    job, as the launcher goes on as torchrun's agent."""
    import subprocess
    import sys

    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return int(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_fits(job: JobConfig, plan: RunPlan) -> str | None:
    """None when every pipeline rank's planned memory fits the device (or nothing to check
    against); else the reason, naming the biggest item and what would shrink it. Activations
    that could not be traced are unknown, not zero: they fail the check too."""
    memory = device_memory_bytes(job)
    if job.memory.check == "off" or memory is None:
        return None
    unknown = None
    for rank, _, b in pipeline_rank_bytes(job, plan):
        items = {
            k: b[k] or 0
            for k in (
                "params_bytes",
                "grads_bytes",
                "optimizer_bytes",
                "copies_bytes",
                "activations_bytes",
                "transient_bytes",
            )
        }
        if job.training.enable_cpu_offload:  # offloaded states live in host memory
            for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                items[k] = 0
        total = sum(items.values())
        if total > memory:
            biggest = max(items, key=items.get)
            return (
                f"rank {rank} would need {human_bytes(total)} (parameters, gradients, "
                f"optimizer states, activations and transient buffers), more than the "
                f"device's {human_bytes(memory)} (memory.device_memory_gib). The biggest "
                f"item: {biggest.removesuffix('_bytes')} {human_bytes(items[biggest])}; "
                f"{_FIXES[biggest]}. See python -m titan.planner"
            )
        if b["activations_bytes"] is None and unknown is None:
            # a rank that surely does not fit, found later, is the better reason
            unknown = (
                f"rank {rank}'s activations could not be traced on fake tensors "
                f"({b['activations_error']}), so whether it fits the device's "
                f"{human_bytes(memory)} is unknown: its parameters, gradients and "
                f"optimizer states alone need {human_bytes(total)}. python -m "
                'titan.planner shows the same; memory.check = "off" skips the '
                "check, and a model that should trace is worth reporting"
            )
    return unknown


def plan_check(job: JobConfig, plan: RunPlan) -> None:
    """The [memory] section's plan check, of a run about to start: states that cannot fit the
    device fail before launch, not as an out-of-memory at step 1 (memory.check = "warn"
    prints the problem and starts)."""
    problem = check_fits(job, plan)
    if problem is None:
        return
    if job.memory.check == "error":
        from titan.config import ConfigError

        raise ConfigError(f'{problem}. memory.check = "warn" launches anyway')
    print(f"titan: warning: {problem}", file=sys.stderr, flush=True)
