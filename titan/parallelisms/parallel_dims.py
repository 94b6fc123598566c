"""Parallel degrees, their validation, and the one DeviceMesh every parallelism draws from."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelismError(ValueError):
    pass


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ParallelismError(f"parallel degree {name} = {getattr(self, name)} must be >= 1")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % rest:
                raise ParallelismError(
                    f"world size {self.world_size} is not divisible by dp_replicate x cp x tp x pp "
                    f"= {rest}; change the degrees or the number of ranks (NGPU)"
                )
            self.dp_shard = self.world_size // rest
        if self.dp_shard < 1:
            raise ParallelismError(f"data_parallel_shard_degree = {self.dp_shard} must be -1 or >= 1")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ParallelismError(
                f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x cp({self.cp}) x "
                f"tp({self.tp}) x pp({self.pp}) = {product}, but the world size is "
                f"{self.world_size}; make the product equal the number of ranks"
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
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Named dims pp, dp_replicate, dp_shard, cp, tp (outer to inner), plus flattened
        "dp" (data loading), "dp_shard_cp" (FSDP) and "dp_cp" (loss averaging)."""
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)]
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        # flattened meshes are kept here: slicing them back out of the root is deprecated
        self._flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
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
        if isinstance(dims, str) and dims in self._flat:
            return self._flat[dims]
        return self._mesh[dims]


def validate_against_model(dims: ParallelDims, model_args, *, seq_len: int,
                           local_batch_size: int, global_batch_size: int,
                           dp_size: int | None = None) -> None:
    """Model- and batch-dependent checks, run before any process group exists.

    `model_args`: a ModelArgs (heads, kv heads, layers). `dp_size`: data-parallel replicas in
    all, when more than the mesh's (torchft groups).
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
    if seq_len % (2 * dims.cp) and dims.cp > 1:
        raise ParallelismError(
            f"training.seq_len {seq_len} must be divisible by 2 x context_parallel_degree "
            f"= {2 * dims.cp} (load balancing splits each sequence into 2 x cp chunks)"
        )
    per_step = local_batch_size * dp_size
    if global_batch_size % per_step:
        raise ParallelismError(
            f"training.global_batch_size {global_batch_size} must be a multiple of "
            f"local_batch_size x dp = {local_batch_size} x {dp_size} = {per_step} "
            "(the remainder would be the gradient-accumulation count)"
        )
