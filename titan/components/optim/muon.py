"""Muon (momentum orthogonalized by Newton-Schulz) for the hidden weight matrices, AdamW for
the rest (embeddings, output head, norms, biases), as Moonlight trains it: the update of a
matrix scaled to AdamW's RMS (0.2 x sqrt(max(rows, cols))), decoupled weight decay on both.

Sharded weights are orthogonalized whole: a matrix split along either of its two dimensions
(FSDP's Shard(0), TP's row or column split) is all-gathered (its momentum-updated gradient, one
matrix at a time), every rank of its mesh iterates on the same full matrix, and each keeps its
own shard of the result. The result is the one process's, bit for bit, whatever the layout; the
cost is one all-gather of the Muon weights per step and the Newton-Schulz flops repeated on
each rank of the mesh. Stacked experts ([experts, rows, cols]) are a batch of matrices: split
by expert (expert parallelism), each rank orthogonalizes its own experts without gathering.
"""

import logging
import math
import re

import torch
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
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    mesh, placements = update.device_mesh, update.placements
    if not _splits_a_matrix(update):  # whole matrices on each rank (experts split by expert)
        return DTensor.from_local(
            newton_schulz(update.to_local(), steps, dtype),
            mesh,
            placements,
            shape=update.shape,
            stride=update.stride(),
        )
    whole = newton_schulz(update.full_tensor(), steps, dtype)
    # from the same whole on every rank, each takes its shard: a local slice, no communication
    return DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)


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
    ):
        super().__init__(groups, dict(betas=betas, eps=eps, muon=False))
        self.momentum, self.nesterov = momentum, nesterov
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
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - self.momentum)
            update = p.grad.lerp(buf, self.momentum) if self.nesterov else buf
            update = orthogonalized(update, self.ns_steps, self.ns_dtype)
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
