"""Parallel degrees, their validation, and the one DeviceMesh every parallelism draws from.

`DIMS` is the one list of the parallel dims: the mesh, the layout a checkpoint records, the
planner's report and its layout search all iterate it, so a new dim is a row here (and a
field of `ParallelDims`, and of the parallelism config section), not an edit in each of them.
"""

from dataclasses import dataclass, field, fields

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelismError(ValueError):
    pass


@dataclass(frozen=True)
class Dim:
    name: str  # the mesh dim, the `ParallelDims` field and the layout record's key
    config_field: str  # the dotted config field that sets its degree
    mesh_position: int  # 0 = outermost dim of the device mesh
    fills: bool = False  # -1 takes whatever the other degrees leave of the world size


# in the order layouts are written (checkpoint markers compare them by key, so the order of
# the keys is the one existing checkpoints hold)
DIMS = (
    Dim("dp_replicate", "parallelism.data_parallel_replicate_degree", 1),
    Dim("dp_shard", "parallelism.data_parallel_shard_degree", 2, fills=True),
    Dim("cp", "parallelism.context_parallel_degree", 3),
    Dim("tp", "parallelism.tensor_parallel_degree", 4),
    Dim("pp", "parallelism.pipeline_parallel_degree", 0),
)
MESH_ORDER = tuple(sorted(DIMS, key=lambda d: d.mesh_position))  # outer to inner
# dims of the mesh made of several named ones: data loading ("dp"), FSDP ("dp_shard_cp") and
# loss averaging ("dp_cp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# with expert parallelism, the ranks of one pipeline stage again as the routed experts see
# them: replicas, the FSDP shards of each expert ("efsdp"), the ranks holding different experts
# ("ep") and the tensor-parallel ranks ("etp", the tp ranks, over which experts are whole);
# `dims["edp"]` is the experts' FSDP mesh (HSDP when there are replicas), `dims["ep_etp"]` the
# mesh their weights are placed on under TP
EXPERT_DIMS = ("edp_replicate", "efsdp", "ep", "etp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    # expert parallelism: not a dim of the mesh but a split of dp_shard x cp (the routed
    # experts' mesh, "ep", with "efsdp" for what is left to shard them over)
    ep: int = 1
    # not init fields: a copy (dataclasses.replace) is a layout whose mesh is not built yet
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_config(cls, job, world_size: int) -> "ParallelDims":
        """The degrees a JobConfig sets, one per row of DIMS."""
        degrees = {}
        for d in DIMS:
            section, attr = d.config_field.split(".")
            degrees[d.name] = getattr(getattr(job, section), attr)
        return cls(**degrees, world_size=world_size, ep=job.parallelism.expert_parallel_degree)

    def degrees(self) -> dict[str, int]:
        """{dim name: degree}, in DIMS order."""
        return {d.name: getattr(self, d.name) for d in DIMS}

    def mesh_dims(self) -> list[tuple[str, int]]:
        """(name, size) of the mesh's named dims, outer to inner."""
        return [(d.name, getattr(self, d.name)) for d in MESH_ORDER]

    def __post_init__(self):
        names = [f.name for f in fields(self) if f.init and f.name not in ("world_size", "ep")]
        if names != [d.name for d in DIMS]:
            raise TypeError(
                f"ParallelDims' degree fields {names} must be the rows of DIMS "
                f"{[d.name for d in DIMS]}, in order"
            )
        for d in DIMS:
            value = getattr(self, d.name)
            if d.fills and value == -1:
                continue
            if value < 1:
                raise ParallelismError(
                    f"{d.config_field.split('.')[-1]} = {value} must be -1 or >= 1"
                    if d.fills
                    else f"parallel degree {d.name} = {value} must be >= 1 ({d.config_field})"
                )
        for d in DIMS:
            if not (d.fills and getattr(self, d.name) == -1):
                continue
            others = [o for o in DIMS if o is not d]
            rest = 1
            for o in others:
                rest *= getattr(self, o.name)
            if self.world_size % rest:
                raise ParallelismError(
                    f"world size {self.world_size} is not divisible by "
                    f"{' x '.join(o.name for o in others)} = {rest}; change the degrees or the "
                    "number of ranks (NGPU)"
                )
            setattr(self, d.name, self.world_size // rest)
        product = 1
        for value in self.degrees().values():
            product *= value
        if product != self.world_size:
            raise ParallelismError(
                " x ".join(f"{name}({value})" for name, value in self.degrees().items())
                + f" = {product}, but the world size is {self.world_size}; make the product "
                "equal the number of ranks"
            )
        if self.ep < 1 or (self.dp_shard * self.cp) % self.ep:
            raise ParallelismError(
                f"expert_parallel_degree {self.ep} must be >= 1 and divide "
                f"data_parallel_shard_degree x context_parallel_degree = "
                f"{self.dp_shard} x {self.cp}: expert parallelism borrows those ranks"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def non_dp(self) -> int:
        """Ranks that work on the same batch (their tokens are counted once)."""
        return self.cp * self.tp * self.pp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """What is left of dp_shard x cp to shard the routed experts over, beside ep."""
        return self.dp_shard * self.cp // self.ep

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named dims of `mesh_dims()`, plus the FLATTENED ones."""
        dims = self.mesh_dims()
        mesh = init_device_mesh(
            device_type,
            tuple(size for _, size in dims),
            mesh_dim_names=tuple(name for name, _ in dims),
        )
        # flattened meshes are kept here: slicing them back out of the root is deprecated
        self._flat = {name: mesh[parts]._flatten(name) for name, parts in FLATTENED.items()}
        if self.ep_enabled:
            # the routed experts' mesh, ep inside dp_cp's ranks and outside tp's: one mesh, so
            # that FSDP can join efsdp to (ep, etp)
            stage = mesh[("dp_replicate", "dp_shard", "cp", "tp")]._flatten("dp_cp_tp")
            experts = stage._unflatten(
                0, (self.dp_replicate, self.efsdp, self.ep, self.tp), EXPERT_DIMS
            )
            self._flat.update(
                {
                    "ep": experts["ep"],
                    "efsdp": experts["efsdp"],
                    "edp": experts[EXPERT_DIMS[:2]],
                    "ep_etp": experts[EXPERT_DIMS[2:]],
                }
            )
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not run")
        return self._mesh

    @property
    def device_type(self) -> str:
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not run")
        return self._mesh.device_type

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by name: a named dim, a flattened dim, or a tuple of them."""
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not run")
        if isinstance(dims, tuple) and len(dims) == 1:
            dims = dims[0]
        if isinstance(dims, str) and dims in self._flat:
            return self._flat[dims]
        return self._mesh[dims]

    def group(self, dim: str):
        """The process group of the mesh dimension `dim`; None where it is one rank."""
        mesh = self[dim]
        return mesh.get_group() if mesh.size() > 1 else None


def heads_group_size(parallelism, cp: int) -> int:
    """The ranks of each all-to-all attention group under context parallelism (the
    parallelism config section): 0 for ring attention, cp for all-to-all, the configured
    degree for the hybrid."""
    return {
        "ring": 0,
        "alltoall": cp,
        "hybrid": parallelism.context_parallel_alltoall_degree,
    }[parallelism.context_parallel_type]


def validate_against_model(
    dims: ParallelDims,
    model_args,
    *,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    dp_size: int | None = None,
    cp_load_balance: bool = True,
) -> None:
    """Model- and batch-dependent checks, run before any process group exists.

    `model_args`: a ModelArgs (heads, kv heads, layers). `dp_size`: data-parallel replicas in
    all, when more than the mesh's (torchft groups). `cp_load_balance`: CP splits each
    sequence into 2 x cp chunks (else cp).
    """
    dp_size = dp_size or dims.dp
    n_heads, n_kv_heads, n_layers = model_args.n_heads, model_args.n_kv_heads, model_args.n_layers
    if n_heads % dims.tp or n_kv_heads % dims.tp:
        raise ParallelismError(
            f"tensor_parallel_degree {dims.tp} must divide n_heads ({n_heads}) and n_kv_heads "
            f"({n_kv_heads}); pick a tp degree that divides both"
        )
    if dims.pp > n_layers:
        raise ParallelismError(
            f"pipeline_parallel_degree {dims.pp} exceeds the model's {n_layers} layers"
        )
    if cp_load_balance and seq_len % (2 * dims.cp) and dims.cp > 1:
        raise ParallelismError(
            f"training.seq_len {seq_len} must be divisible by 2 x context_parallel_degree "
            f"= {2 * dims.cp} (load balancing splits each sequence into 2 x cp chunks)"
        )
    if not cp_load_balance and seq_len % dims.cp:
        raise ParallelismError(
            f"training.seq_len {seq_len} must be divisible by context_parallel_degree "
            f"{dims.cp} (each cp rank holds an equal part of every sequence)"
        )
    per_step = local_batch_size * dp_size
    if global_batch_size % per_step:
        raise ParallelismError(
            f"training.global_batch_size {global_batch_size} must be a multiple of "
            f"local_batch_size x dp = {local_batch_size} x {dp_size} = {per_step} "
            "(the remainder would be the gradient-accumulation count)"
        )
