"""`python -m titan.planner --suggest`: the layouts of N GPUs that fit, ranked by a step-time model.

Candidates: every choice of the degrees of `parallel_dims.DIMS` (dp_replicate x dp_shard x cp
x tp x pp today) whose product is N, for an MoE also every expert-parallel degree that divides
dp_shard x cp, with CP both ring and all-to-all, that the config validation accepts
(the launcher's own `plan_run`), at the configured global batch, each with the cheapest
activation checkpointing (none, then selective, then full) and the largest local batch
(then halved, accumulating gradients) whose planned peak (`titan.planner.memory`) leaves
`margin` of the device memory free.

Step time, per rank, the documented model (for ranking, not a promise):
- compute = model FLOPs of the step / N / (peak x efficiency), x 7/6 under selective AC
  (half the matmuls recomputed), x 4/3 under full AC (the forward again);
- pipeline bubble = compute x (pp - 1) / (microbatches x stages per rank);
- communication, bytes over the link of each mesh dim (NVLink inside a node, the network
  across; the mesh's dims innermost first: tp, cp, dp_shard, dp_replicate, pp): TP all-gathers
  and reduce-scatters of activations (4 per layer, forward and backward), CP's ring of K and
  V (or, all-to-all CP, q, k, v and the output exchanged, forward and backward; the hybrid
  adds a ring of its groups' K and V across the groups) are exposed;
  FSDP's all-gathers and reduce-scatter and HSDP's all-reduce are hidden behind compute up to
  the compute time; pipeline sends are exposed. An MoE's routed experts are whole on the tp
  ranks and split over ep, so their FSDP traffic is over efsdp = dp_shard x cp / ep; expert
  parallelism's all-to-alls (dispatch and combine, forward and backward: 4 a MoE layer, top_k
  rows a token, (ep-1)/ep of them leaving the rank) are exposed.
- Muon's step (optimizer.name = "Muon"): the Newton-Schulz flops of the rank's matrices
  (steps x (4 m^2 n + 2 m^3) a matrix, m <= n its sides), a split matrix's divided among the
  dp_shard x cp x tp ranks that shard it (each iterated on one of them), stacked experts
  iterated where they lie (split over ep and efsdp); the gather and broadcast of the split
  ones (float32) exposed.
"""

import itertools
from dataclasses import dataclass, field

from titan.config import ConfigError, JobConfig
from titan.config.manager import with_overrides
from titan.parallelisms.parallel_dims import DIMS, ParallelDims, heads_group_size
from titan.plan.run_plan import RunPlan

AC_COST = {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}
SOURCE = "--suggest"  # where a candidate's settings come from, as the config parser records it


@dataclass
class Hardware:
    peak_flops: float = 989e12  # H100 SXM dense bf16
    efficiency: float = 0.5  # achieved share of the peak by matmuls
    intra_node_bw: float = 450e9  # bytes/s per GPU, NVLink 4
    inter_node_bw: float = 50e9  # bytes/s per GPU, 400 Gb/s
    gpus_per_node: int = 8


EP_FIELD = "parallelism.expert_parallel_degree"
CP_TYPE_FIELD = "parallelism.context_parallel_type"
CP_A2A_FIELD = "parallelism.context_parallel_alltoall_degree"
# a candidate's degrees: the mesh dims and expert parallelism (a split of dp_shard x cp); how
# CP attends (ring, all-to-all or the hybrid) and, for the hybrid only, its all-to-all groups
LAYOUT_FIELDS = {
    **{d.name: d.config_field for d in DIMS},
    "ep": EP_FIELD,
    "cp_type": CP_TYPE_FIELD,
    "cp_a2a": CP_A2A_FIELD,
}


def settings(layout: dict, ac: str, local_batch: int, global_batch: int) -> dict:
    """A candidate as config fields (dotted names): the one definition both the planned job
    and the printed overrides are made from."""
    return {
        **{LAYOUT_FIELDS[k]: v for k, v in layout.items() if k != "cp_a2a" or _hybrid(layout)},
        "activation_checkpoint.mode": ac,
        "training.local_batch_size": local_batch,
        "training.global_batch_size": global_batch,
    }


def apply_settings(job: JobConfig, fields: dict) -> JobConfig:
    """The job with a candidate's settings, through the config parser: checked and validated
    like the printed overrides will be, each recorded as coming from --suggest."""
    return with_overrides(job, fields, SOURCE)


@dataclass
class Candidate:
    fields: dict  # `settings(...)`
    grad_accum: int
    peak_bytes: int
    step_s: float
    parts: dict = field(default_factory=dict)

    @property
    def layout(self) -> dict:
        return {k: self.fields[name] for k, name in LAYOUT_FIELDS.items() if name in self.fields}

    @property
    def ac(self) -> str:
        return self.fields["activation_checkpoint.mode"]

    @property
    def local_batch_size(self) -> int:
        return self.fields["training.local_batch_size"]

    def overrides(self) -> list[str]:
        return [arg for name, value in self.fields.items() for arg in (f"--{name}", str(value))]


def factorizations(n: int, k: int):
    """Ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, k - 1):
                yield (d, *rest)


def _hybrid(layout: dict) -> bool:
    return layout.get("cp_type") == "hybrid"


def _cp_types(cp: int, tp: int, heads: tuple[int, int]):
    """How CP may attend at degree `cp`: ring; all-to-all where each TP rank's query and kv
    heads divide by cp; else the hybrid with the largest all-to-all group that divides them
    (under the step-time model all-to-all over the whole of cp moves less than any hybrid,
    whose groups pass each other's K and V round a ring: the hybrid is priced where it is the
    only head split)."""
    if cp == 1:
        yield {"cp_type": "ring"}
        return
    yield {"cp_type": "ring"}

    def splits(a):
        return all(h % tp == 0 and (h // tp) % a == 0 for h in heads)

    if splits(cp):
        yield {"cp_type": "alltoall"}
        return
    groups = [a for a in range(cp - 1, 1, -1) if cp % a == 0 and splits(a)]
    if groups:
        yield {"cp_type": "hybrid", "cp_a2a": groups[0]}


def _layouts(world_size: int, n_experts: int, heads: tuple[int, int] = (1, 1)):
    """The candidate layouts of every factorization of `world_size`, once per
    expert-parallel degree that divides dp_shard x cp and the routed experts (1 for a dense
    model), and per CP type that can split `heads` (query heads, kv heads; (1, 1): ring
    only)."""
    names = [d.name for d in DIMS]
    for degrees in factorizations(world_size, len(DIMS)):
        mesh = dict(zip(names, degrees))
        borrowable = mesh["dp_shard"] * mesh["cp"]
        for ep in range(1, borrowable + 1):
            if borrowable % ep == 0 and n_experts % ep == 0:
                for cp in _cp_types(mesh["cp"], mesh["tp"], heads):
                    yield {**mesh, "ep": ep, **cp}


def step_time(job: JobConfig, plan, hw: Hardware, world_size: int) -> tuple[float, dict]:
    """(seconds, the parts) of one step under the model in the module docstring."""
    t, d, args = job.training, plan.dims, plan.model_args
    tokens = plan.global_batch_size * t.seq_len
    compute = (
        args.flops_per_token(t.seq_len)
        * tokens
        / world_size
        / (hw.peak_flops * hw.efficiency)
        * AC_COST[job.activation_checkpoint.mode]
    )
    parts = {"compute": compute}
    bw, inner = {}, 1
    for name, size in reversed(d.mesh_dims()):  # innermost first
        inner *= size
        bw[name] = hw.intra_node_bw if inner <= hw.gpus_per_node else hw.inter_node_bw
    act = 2  # bytes per activation element (bf16)
    local_tokens = plan.global_batch_size // d.dp * t.seq_len // d.cp  # per rank per step
    layers = args.n_layers / d.pp
    if d.tp > 1:  # 4 collectives a layer, forward and backward, of (tp-1)/tp of a hidden
        parts["tp"] = 8 * layers * local_tokens * args.dim * act * (d.tp - 1) / d.tp / bw["tp"]
    kv_heads = getattr(args, "n_kv_heads", None) or args.n_heads
    a = heads_group_size(job.parallelism, d.cp)
    if d.cp > 1 and a:
        # q, k, v in and the output back, forward and backward, (a-1)/a of each leaving;
        # each tp rank exchanges its own heads
        width = (2 * args.n_heads + 2 * kv_heads) * args.head_dim / d.tp
        parts["cp"] = 2 * layers * local_tokens * width * act * (a - 1) / a / bw["cp"]
        if a < d.cp:  # the hybrid: its group's K and V of its heads round the ring of groups
            kv = 2 * a * local_tokens * kv_heads / a * args.head_dim / d.tp * act
            parts["cp"] += 3 * layers * kv * (d.cp // a - 1) / bw["cp"]
    elif d.cp > 1:  # K and V around the ring, forward; and their gradients, backward
        # keys and values: n_kv_heads x head_dim each (head_dim need not be dim / n_heads)
        kv = 2 * local_tokens * kv_heads * args.head_dim * act
        parts["cp"] = 3 * layers * kv * (d.cp - 1) / bw["cp"]
    moe = args.moe_args()
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers)) / d.pp if moe else 0
    routed = 3 * args.dim * moe.hidden_dim * moe.n_experts * moe_layers if moe else 0
    # (parameters of this rank's FSDP units, the ranks sharding them): the dense ones split by
    # tp over dp_shard x cp, the routed experts split by ep over efsdp
    units = [
        ((args.num_params() / d.pp - routed) / d.tp, d.dp_shard * d.cp),
        (routed / d.ep, d.efsdp),
    ]
    hidden = 0.0
    for params, shard in units:
        if shard > 1:  # all-gather twice (bf16), reduce-scatter once (fp32)
            hidden += params * (2 * 2 + 4) * (shard - 1) / shard / bw["dp_shard"]
        if d.dp_replicate > 1:
            hidden += (
                2 * params * 4 / shard * (d.dp_replicate - 1) / d.dp_replicate / bw["dp_replicate"]
            )
    parts["data-parallel (exposed)"] = max(0.0, hidden - compute)
    if d.ep > 1:  # each tp rank dispatches its share of the tokens (SP)
        ep_bw = hw.intra_node_bw if d.tp * d.ep <= hw.gpus_per_node else hw.inter_node_bw
        rows = local_tokens / d.tp * moe.top_k
        parts["ep all-to-all"] = 4 * moe_layers * rows * args.dim * act * (d.ep - 1) / d.ep / ep_bw
    if d.pp > 1:
        n_mb = plan.global_batch_size // d.dp // job.parallelism.pipeline_parallel_microbatch_size
        per_rank = len(plan.pipeline(0).stage_ids)
        parts["bubble"] = compute * (d.pp - 1) / (n_mb * per_rank)
        parts["pp sends"] = 2 * local_tokens * args.dim * act / bw["pp"]
    if job.optimizer.name == "Muon":
        flops, gathered = muon_work(job, plan)
        parts["muon"] = flops / (hw.peak_flops * hw.efficiency) + gathered / bw["dp_shard"]
    return sum(parts.values()), parts


def _ns_flops(shape, steps: int) -> float:
    m, n = sorted(shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return steps * batch * (4 * m * m * n + 2 * m**3)


def muon_work(job: JobConfig, plan, divide: bool = True) -> tuple[float, float]:
    """(Newton-Schulz flops, bytes gathered and broadcast) of one rank's Muon step; without
    `divide`, every rank iterating every split matrix (gathered, not broadcast)."""
    import re

    d, m = plan.dims, job.extensions["muon"]
    skip = re.compile(m.adamw_params)
    steps = m.ns_steps
    shards = d.dp_shard * d.cp * d.tp  # the ranks a dense matrix is split over
    flops = moved = 0.0
    for name, shape in _matrices(plan):
        if len(shape) < 2 or skip.search(name):
            continue
        if len(shape) >= 3:  # stacked experts: whole where they lie
            flops += _ns_flops(shape, steps) / (d.ep * d.efsdp)
            continue
        flops += _ns_flops(shape, steps) / (shards if divide else 1)
        if shards > 1:  # gathered whole, then broadcast from its rank: (s-1)/s each way
            moved += (2 if divide else 1) * 4 * shape[0] * shape[1] * (shards - 1) / shards
    return flops / d.pp, moved / d.pp


_SHAPES: dict = {}


def _matrices(plan) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters (name, shape), from its meta build (once per architecture)."""
    key = (plan.spec.name, repr(plan.model_args))
    if key not in _SHAPES:
        model = plan.spec.build_meta(plan.model_args)
        _SHAPES[key] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return _SHAPES[key]


def suggest(
    job: JobConfig,
    base: RunPlan,
    device_memory: int,
    hw: Hardware,
    margin: float = 0.1,
    top: int = 5,
) -> list[Candidate]:
    """The `top` fastest candidates on the world size of `base`, the job's RunPlan."""
    from titan.plan.run_plan import plan_run
    from titan.planner.memory import pipeline_rank_bytes

    world_size, global_batch = base.dims.world_size, base.global_batch_size
    budget = device_memory * (1 - margin)
    found = []
    args = base.model_args
    moe = args.moe_args()
    heads = (args.n_heads, getattr(args, "n_kv_heads", None) or args.n_heads)
    for layout in _layouts(world_size, moe.n_experts if moe else 1, heads):
        degrees = {k: v for k, v in layout.items() if k not in ("cp_type", "cp_a2a")}
        dp = ParallelDims(**degrees, world_size=world_size).dp
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        batches = [b for b in (per_rank >> i for i in range(8)) if b and per_rank % b == 0]
        for ac, local in itertools.product(AC_COST, dict.fromkeys(batches)):
            fields = settings(layout, ac, local, global_batch)
            try:
                candidate = apply_settings(job, fields)
                plan = plan_run(candidate, world_size, tokenizer=base.tokenizer)
            except ConfigError:
                continue
            ranks = [b for _, _, b in pipeline_rank_bytes(candidate, plan)]
            if any(b["activations_bytes"] is None for b in ranks):
                continue  # not traced: no claim that it fits
            peak = max(b["total_bytes"] for b in ranks)
            if peak <= budget:
                seconds, parts = step_time(candidate, plan, hw, world_size)
                found.append(Candidate(fields, plan.grad_accum_steps, peak, seconds, parts))
                break  # the cheapest AC and the biggest batch that fit: go to the next layout
        # (a layout none of whose settings fit adds nothing)
    found.sort(key=lambda c: (c.step_s, c.peak_bytes))
    return found[:top]
