"""Context parallelism: ring attention over the "cp" mesh dim, on CUDA and on CPU/gloo.

Wrap the forward and backward of one microbatch in `context_parallel_ctx(...)`. Inside it,
the given buffers (inputs, labels, the RoPE table) are sharded in place along their sequence
dims (head-tail reordered when load balancing) and `F.scaled_dot_product_attention` runs as
ring attention: each rank keeps its query chunk and the K/V chunks travel round the cp group.

CUDA uses torch's `context_parallel` unchanged. On CPU torch's CP dispatch table only knows
the CUDA SDPA kernels, so SDPA on Shard(2) DTensors fails with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered". While the context is active we add DTensor handlers for the CPU flash op and its
backward that run torch's templated ring-attention forward/backward with the CPU kernels.

The handlers short-circuit DTensor dispatch and build their output specs themselves, so no
sharding rule is ever registered for the CPU ops: a Shard(2) SDPA outside the context keeps
failing loudly instead of running attention on local shards only (silently wrong), and
DTensor's sharding-propagation caches cannot hold a stale CP rule after exit.

Private torch APIs used: `_cp_options` and `set_rotate_method` (both devices) from
torch.distributed.tensor.experimental._attention; on CPU also `_templated_ring_attention`,
`_templated_ring_attention_backward` and `_create_rotater` from
...experimental._context_parallel._attention,
`DTensor._op_dispatcher._custom_op_handlers` / `.wrap`, and `DTensorSpec` / `TensorMeta` from
torch.distributed.tensor._dtensor_spec; for the hybrid's groups `DeviceMesh._unflatten` and
torch._subclasses.fake_tensor's `unset_fake_temporarily`. `check_torch_version` pins the
allowed range.
"""

import contextlib
import re
from collections.abc import Iterator

import torch
import torch.distributed.tensor.experimental._attention as _torch_cp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental import context_parallel
from torch.utils._pytree import tree_map_only

from titan.parallelisms.sequence_shard import SequenceShard, activated

# Allowed (major, minor) ranges, [low, high). CPU relies on torch's private ring-attention
# internals and is pinned to the version its tests ran with. CUDA runs torch's own CP path,
# allowed from 2.11 (the lent GPU machines' torch) but not yet run on a GPU by titan.
_VERSIONS = {"cuda": ((2, 11), (2, 14)), "cpu": ((2, 13), (2, 14))}
_STATUS = {
    "cuda": "is allowed (torch's own context_parallel; not yet run on a GPU by titan)",
    "cpu": "was tested",
}

_aten = torch.ops.aten
_CPU_FWD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ_DIM = 2  # SDPA layout (batch, heads, seq, head_dim)


def check_torch_version(device_type: str = "cpu", version: str | None = None) -> None:
    """Raise RuntimeError unless CP on `device_type` is allowed with this torch version."""
    version = torch.__version__ if version is None else version
    device = "cuda" if device_type == "cuda" else "cpu"
    low, high = _VERSIONS[device]
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and low <= (int(m[1]), int(m[2])) < high:
        return
    allowed = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    raise RuntimeError(
        f"context parallelism on {device} {_STATUS[device]} with torch {allowed}, but torch "
        f"{version} is installed. Install a torch in that range, or disable CP "
        "(parallelism.context_parallel_degree = 1). To support this version, run "
        "tests/unit/test_context_parallel.py with it and, if it passes, widen _VERSIONS in "
        "titan/parallelisms/context_parallel.py (on CPU, CP depends on private torch "
        "ring-attention internals that change between releases)."
    )


def context_parallel_ctx(
    cp_mesh: DeviceMesh,
    buffers: list[torch.Tensor],
    seq_dims: list[int],
    no_restore_buffers: set[torch.Tensor],
    rotate_method: str,
    load_balance: bool,
    heads_group: int = 0,
) -> contextlib.AbstractContextManager:
    """A context manager for one microbatch's forward+backward under CP.

    `buffers` are sharded in place along `seq_dims` on entry and restored on exit, except
    those in `no_restore_buffers`. `rotate_method` is "allgather" or "alltoall" (ring's);
    `load_balance` turns on head-tail reordering (needs seq_len divisible by 2 x cp);
    `heads_group`: 0 for ring attention; else all-to-all attention over groups of that many
    ranks (sequence_shard.SequenceShard.heads_in): cp for Ulysses, fewer for the hybrid, whose
    groups gather each other's keys and values.
    """
    check_torch_version(cp_mesh.device_type)
    if cp_mesh.ndim != 1:
        raise ValueError(f"the context-parallel mesh must be 1-D, got {cp_mesh.ndim} dims")
    if load_balance:
        for buf, dim in zip(buffers, seq_dims):
            if buf.shape[dim] % (2 * cp_mesh.size()):
                # torch would silently fall back to no load balancing
                raise ValueError(
                    f"load-balanced CP needs sequence length {buf.shape[dim]} (a buffer of shape "
                    f"{tuple(buf.shape)}, dim {dim}) divisible by 2 x cp = {2 * cp_mesh.size()}"
                )
    return _cp_context(
        cp_mesh, buffers, seq_dims, no_restore_buffers, rotate_method, load_balance, heads_group
    )


_SPLITS: dict = {}


def _heads_groups(cp_mesh: DeviceMesh, size: int):
    """(the all-to-all group of this rank, the group across: one rank of each all-to-all
    group) for groups of `size` consecutive cp ranks; made once per mesh (collectively)."""
    key = (id(cp_mesh), size)
    # the entry keeps its mesh alive: a freed mesh's id (the planner makes many) is never
    # reused for another mesh while its groups are cached
    if key not in _SPLITS:
        if size == cp_mesh.size():
            _SPLITS[key] = (cp_mesh, cp_mesh.get_group(), None)
        else:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            # the mesh's own tensors are real even where the step is traced (the planner)
            with unset_fake_temporarily():
                split = cp_mesh._unflatten(
                    0, (cp_mesh.size() // size, size), ("cp_across", "cp_a2a")
                )
            _SPLITS[key] = (cp_mesh, split["cp_a2a"].get_group(), split["cp_across"].get_group())
    return _SPLITS[key][1:]


@contextlib.contextmanager
def _cp_context(
    cp_mesh, buffers, seq_dims, no_restore_buffers, rotate_method, load_balance, heads_group
) -> Iterator[None]:
    opts = _torch_cp._cp_options
    saved = (opts.rotate_method, opts.enable_load_balance)
    # each token's position, sharded as the batch is: what attention with other masks than
    # ring attention's causal one needs (titan.parallelisms.sequence_shard)
    positions = torch.arange(buffers[0].shape[seq_dims[0]], device=buffers[0].device)
    try:
        _torch_cp.set_rotate_method(rotate_method)
        # torch's context_parallel picks the head-tail balancer iff this flag is set
        opts.enable_load_balance = load_balance
        with context_parallel(
            cp_mesh,
            buffers=[*buffers, positions],
            buffer_seq_dims=[*seq_dims, 0],
            no_restore_buffers={*no_restore_buffers, positions},
        ):
            # entered after torch's: it swaps in a fresh handler dict, which we extend
            # all-to-all attention calls no SDPA on shards: the ring handlers stay out
            ring = (
                _cpu_ring_handlers()
                if cp_mesh.device_type == "cpu" and not heads_group
                else contextlib.nullcontext()
            )
            if heads_group:
                group, across = _heads_groups(cp_mesh, heads_group)
                shard = SequenceShard(group, positions, by_heads=True, across=across)
            else:
                shard = SequenceShard(cp_mesh.get_group(), positions)
            with ring, activated(shard):
                yield
    finally:
        # process-global options: leave them as found
        opts.rotate_method, opts.enable_load_balance = saved


@contextlib.contextmanager
def _cpu_ring_handlers() -> Iterator[None]:
    # torch's ring internals are imported here, on first CPU use: CUDA never needs them
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    handlers = DTensor._op_dispatcher._custom_op_handlers
    previous = {op: handlers[op] for op in _HANDLERS if op in handlers}
    handlers.update(_HANDLERS)
    create_rotater = ring._create_rotater
    ring._create_rotater = lambda *args, **kwargs: _OneExchangeInFlight(
        create_rotater(*args, **kwargs)
    )
    try:
        yield
    finally:
        ring._create_rotater = create_rotater
        for op in _HANDLERS:
            handlers.pop(op, None)
        handlers.update(previous)


def _dtensor_handler(ring_fn):
    """A DTensor custom-op handler: unwrap the Shard(2) inputs, run `ring_fn` on the local
    shards, and wrap the results as Shard(2) DTensors.

    Output specs come from running the op on meta tensors of the global shapes, not from
    DTensor's sharding propagation, so no sharding rule for the CPU op is ever registered.
    """

    def handler(op_call, args, kwargs):
        meshes = set()

        def unwrap(t: DTensor) -> torch.Tensor:
            if tuple(t.placements) != (Shard(_SEQ_DIM),):
                raise NotImplementedError(
                    f"CPU ring attention expects Shard({_SEQ_DIM}) inputs, got {t.placements}"
                )
            meshes.add(t.device_mesh)
            return t._local_tensor

        local_args, local_kwargs = tree_map_only(DTensor, unwrap, (args, kwargs))
        if len(meshes) != 1:
            raise AssertionError(f"CPU ring attention inputs span {len(meshes)} meshes")
        mesh = meshes.pop()
        local_out = ring_fn(mesh.get_group(), *local_args, **local_kwargs)

        def to_meta(t: DTensor) -> torch.Tensor:  # the global tensor's metadata, no data
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        meta_args, meta_kwargs = tree_map_only(DTensor, to_meta, (args, kwargs))
        specs = tuple(
            DTensorSpec(mesh, (Shard(_SEQ_DIM),), TensorMeta(g.shape, g.stride(), g.dtype))
            for g in op_call(*meta_args, **meta_kwargs)
        )
        return DTensor._op_dispatcher.wrap(tuple(local_out), specs)

    return handler


class _OneExchangeInFlight:
    """A ring rotater whose exchange has completed when `exchange_buffers` returns.

    torch's ring backward overlaps the K/V rotation with the dK/dV rotation, so an all-gather
    (or all-to-all) and an all-to-all are in flight on the cp group at once. On gloo (torch
    2.13) that now and then corrupts the heap (glibc aborts with "malloc(): unaligned tcache
    chunk detected"); scripts/gloo_overlap_check.py reproduces it with bare functional
    collectives. So on CPU each exchange is awaited at once, at 11-15% of CP throughput
    (benchmarks/RESULTS.md); CUDA keeps torch's overlap.
    """

    def __init__(self, rotater):
        self._rotater = rotater

    def exchange_buffers(self, buffer: torch.Tensor) -> None:
        self._rotater.exchange_buffers(buffer)
        self._rotater.next_buffer()  # waits; asking again later returns the same buffer

    def next_buffer(self) -> torch.Tensor:
        return self._rotater.next_buffer()


# The two ring functions mirror the CPU ops' schemas (see native_functions.yaml). They run
# inside _cpu_ring_handlers, which has imported torch's ring internals.
def _ring_forward(
    group, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    if dropout_p or attn_mask is not None:
        raise NotImplementedError("CPU ring attention supports neither dropout nor attn_mask")
    return ring._templated_ring_attention(
        group,
        _SEQ_DIM,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=0.0,
        scale=scale,
    )


def _ring_backward(
    group,
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    dropout_p,
    is_causal,
    *,
    attn_mask=None,
    scale=None,
):
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    return ring._templated_ring_attention_backward(
        group,
        _SEQ_DIM,
        _CPU_BWD,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


_HANDLERS = {_CPU_FWD: _dtensor_handler(_ring_forward), _CPU_BWD: _dtensor_handler(_ring_backward)}
