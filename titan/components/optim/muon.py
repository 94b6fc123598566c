"""Muon (momentum orthogonalized by Newton-Schulz) for the hidden weight matrices, AdamW for
the rest (embeddings, output head, norms, biases), as Moonlight trains it: the update of a
matrix scaled to AdamW's RMS (0.2 x sqrt(max(rows, cols))), decoupled weight decay on both.

Sharded weights are orthogonalized whole: a matrix split along either of its two dimensions
(FSDP's Shard(0), TP's row or column split) is all-gathered (its momentum-updated gradient),
one rank of its mesh iterates on it (the matrices divided among the ranks by their cost, the
ranks iterating at once), the result is broadcast from that rank, and each keeps its own shard.
The result is the one process's, bit for bit, whatever the layout; the cost is an all-gather
and a broadcast of the Muon weights per step, and the Newton-Schulz flops divided by the
mesh's size (torchtitan's DistMuon and Megatron's layer-wise optimizer divide them too).
Stacked experts ([experts, rows, cols]) are a batch of matrices: split by expert (expert
parallelism), each rank orthogonalizes its own experts without gathering.
"""

import logging
import math
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan.components.optim.low_precision_adam import adam_state, adam_update
from titan.runtime.dtypes import to_dtype


class _OneGatherIsExact(logging.Filter):
    """A weight sharded by FSDP and TP is gathered in two all-gathers, which torch warns of
    on every call as if it were a reduction that could differ between ranks; a gather has no
    arithmetic, so every rank holds the same whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather operations" not in record.getMessage()


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_OneGatherIsExact())

# the quintic iteration of Keller Jordan's Muon (as torch.optim.Muon's)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonal factor of each matrix in `g` (its last two dimensions), approximately."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transposed else x).to(g.dtype)


def _splits_a_matrix(t: DTensor) -> bool:
    matrix_dims = {t.ndim - 2, t.ndim - 1}
    return any(
        (p.is_shard() and p.dim % t.ndim in matrix_dims) or p.is_partial() for p in t.placements
    )


def orthogonalized(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """One update orthogonalized on this rank (a split matrix gathered whole first)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    if not _splits_a_matrix(update):  # whole matrices on each rank (experts split by expert)
        return _local_ns(update, steps, dtype)
    return _sharded_like(newton_schulz(update.full_tensor(), steps, dtype), update)


def _local_ns(update: DTensor, steps: int, dtype: torch.dtype) -> DTensor:
    return DTensor.from_local(
        newton_schulz(update.to_local(), steps, dtype),
        update.device_mesh,
        update.placements,
        shape=update.shape,
        stride=update.stride(),
    )


def _sharded_like(whole: torch.Tensor, like: DTensor) -> DTensor:
    # from the same whole on every rank, each takes its shard: a local slice, no communication
    mesh = like.device_mesh
    return DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim).redistribute(
        mesh, like.placements
    )


# the whole matrices one round of the divided iteration gathers at once, at most (beside one
# per rank of the mesh): bounds the memory a round holds on meshes of many ranks
ROUND_BYTES = 2 << 30


def _cost(shape: torch.Size) -> int:
    rows, cols = shape[-2], shape[-1]
    return math.prod(shape[:-2]) * rows * cols * min(rows, cols)  # NS's matmuls, up to a factor


def owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """The rank (of `ranks`) that orthogonalizes each matrix: the costliest first, each to the
    least loaded rank so far (the lowest on a tie); the same on every rank."""
    load, out = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + _cost(shapes[i])
    return out


def _rounds(owner: list[int], nbytes: list[int]) -> list[list[int]]:
    """The matrices in rounds, each holding at most one matrix of each rank (so the ranks
    iterate at once) and whole matrices within ROUND_BYTES (one at least)."""
    queues = [[i for i, o in enumerate(owner) if o == r] for r in sorted(set(owner))]
    order = [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]
    rounds, size, taken = [], 0, set()
    for i in order:
        if not rounds or owner[i] in taken or size + nbytes[i] > ROUND_BYTES:
            rounds.append([])
            size, taken = 0, set()
        rounds[-1].append(i)
        size += nbytes[i]
        taken.add(owner[i])
    return rounds


_GROUPS: dict[int, tuple] = {}


def _mesh_group(mesh) -> dist.ProcessGroup:
    """The process group of all of `mesh`'s ranks (a flattened one for a mesh of several
    dimensions, made once: the entry keeps its mesh alive, so its id is not reused)."""
    if id(mesh) not in _GROUPS:
        flat = mesh if mesh.ndim == 1 else mesh._flatten()
        _GROUPS[id(mesh)] = (mesh, flat.get_group())
    return _GROUPS[id(mesh)][1]


def orthogonalized_divided(
    updates: list[torch.Tensor], steps: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Each update orthogonalized, as `orthogonalized` gives it, with the Newton-Schulz
    iterations of the split matrices divided among the ranks of their mesh: each matrix is
    gathered whole (as before), iterated on its one owner (`owners`), and broadcast from it;
    each rank keeps its shard. Bitwise what every rank iterating every matrix gives."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    by_mesh: dict[int, list[int]] = {}
    for i, u in enumerate(updates):
        # a mesh of several unnamed dimensions cannot be flattened into one group: its
        # matrices are iterated on each rank
        if (
            isinstance(u, DTensor)
            and _splits_a_matrix(u)
            and (u.device_mesh.ndim == 1 or u.device_mesh.mesh_dim_names)
        ):
            by_mesh.setdefault(id(u.device_mesh), []).append(i)
        else:
            out[i] = orthogonalized(u, steps, dtype)
    for members in by_mesh.values():
        group = _mesh_group(updates[members[0]].device_mesh)
        me = dist.get_rank(group)
        shapes = [updates[i].shape for i in members]
        owner = owners(shapes, dist.get_world_size(group))
        nbytes = [updates[i].numel() * updates[i].element_size() for i in members]
        for round_ in _rounds(owner, nbytes):
            wholes, works = {}, []
            for k in round_:  # the gathers first, in the same order on every rank
                wholes[k] = updates[members[k]].full_tensor()
            for k in round_:
                if owner[k] == me:
                    wholes[k] = newton_schulz(wholes[k], steps, dtype)
            for k in round_:
                works.append(
                    dist.broadcast(wholes[k], group_src=owner[k], group=group, async_op=True)
                )
            for w in works:
                w.wait()
            for k in round_:
                out[members[k]] = _sharded_like(wholes.pop(k), updates[members[k]])
    return out


def lr_scale(shape: torch.Size, adjust_lr: str) -> float:
    rows, cols = shape[-2], shape[-1]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))  # "original": Keller Jordan's


class Muon(torch.optim.Optimizer):
    """Groups with `muon=True` take Muon's step, the others AdamW's; each keeps its group's
    lr and weight decay (set per group by optimizer.param_groups and the lr schedule)."""

    def __init__(
        self,
        groups: list[dict],
        *,
        betas: tuple[float, float],
        eps: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        ns_dtype: torch.dtype,
        adjust_lr: str,
        divide: bool = True,
    ):
        """`divide`: each split matrix's iteration on one rank of its mesh
        (orthogonalized_divided); else on every rank."""
        super().__init__(groups, dict(betas=betas, eps=eps, muon=False))
        self.momentum, self.nesterov, self.divide = momentum, nesterov, divide
        self.ns_steps, self.ns_dtype, self.adjust_lr = ns_steps, ns_dtype, adjust_lr

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)
        return loss

    def _muon_step(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        updates = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - self.momentum)
            updates.append(p.grad.lerp(buf, self.momentum) if self.nesterov else buf)
        if self.divide:
            updates = orthogonalized_divided(updates, self.ns_steps, self.ns_dtype)
        else:
            updates = [orthogonalized(u, self.ns_steps, self.ns_dtype) for u in updates]
        for p, update in zip(params, updates, strict=True):
            p.mul_(1 - lr * decay)
            p.add_(update, alpha=-lr * lr_scale(p.shape, self.adjust_lr))

    def _adamw_step(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [adam_state(self.state[p], p, p.dtype, fused=False) for p in params]
        adam_update(
            params,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            group,
            implementation="for-loop",
            decoupled=True,
        )


def build(groups: list[dict], cfg, options) -> Muon:
    """Each group split into its Muon matrices (two or more dimensions, names not matching
    muon.adamw_params) and the rest."""
    adamw_only = re.compile(options.adamw_params)
    split = []
    for group in groups:
        for muon in (True, False):
            picked = [
                (n, p)
                for n, p in zip(group["param_names"], group["params"], strict=True)
                if (p.ndim >= 2 and not adamw_only.search(n)) == muon
            ]
            if picked:
                split.append(
                    {
                        **group,
                        "muon": muon,
                        "param_names": [n for n, _ in picked],
                        "params": [p for _, p in picked],
                    }
                )
    return Muon(
        split,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        momentum=options.momentum,
        nesterov=options.nesterov,
        ns_steps=options.ns_steps,
        ns_dtype=to_dtype(options.ns_dtype),
        adjust_lr=options.adjust_lr,
    )
