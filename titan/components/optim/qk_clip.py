"""QK-clip (Kimi K2's MuonClip), after each optimizer step: each attention head whose largest
pre-softmax logit in the step exceeded tau has its query/key rows rescaled so that, on the same
inputs, that logit would be tau (gamma = tau / max; how the rows take gamma is the attention
module's `qk_clip_scales`). Works after any optimizer; the optimizer's state is untouched.

The converter asks every attention module to keep its heads' largest logit over the step's
forwards (titan.models.common.logit_max). After the step one max-all-reduce of a (attention
modules, heads) table gives every rank the maximum over every rank that saw a head: data and
pipeline ranks fill what they saw (-inf elsewhere), a tensor-parallel rank the columns of its
own heads. Each rank then rescales the rows it holds (of a DTensor, its shard's rows), so
every layout clips the heads one process clips, by the same factors. A head under tau is
multiplied by 1, exactly: no step waits on the device to learn which heads to clip.
"""

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan.components.converters import Converter
from titan.components.optim.registry import clean_name

logger = logging.getLogger(__name__)


def _tracked(model: nn.Module):
    for name, module in model.named_modules():
        if getattr(module, "logit_max", None) is not None:
            yield clean_name(name), module


class QKClipConverter(Converter):
    def __init__(self, job):
        self.tau = job.optimizer.qk_clip_threshold
        self.names: list[str] = []  # every attention module of the whole model: the table rows
        self.heads = 0

    def convert(self, model) -> None:
        for name, module in model.named_modules():
            if hasattr(module, "track_logit_max"):
                module.track_logit_max()
                self.names.append(clean_name(name))
                self.heads = max(self.heads, module.n_heads)

    def init_weights(self, part, seed: int) -> None:
        for _, module in _tracked(part):
            module.logit_max.fill_(float("-inf"))

    def describe(self, parts, pipelined: bool) -> None:
        logger.info(
            "QK-clip: %d attention layers, heads whose logits pass %g are rescaled after each step",
            len(self.names),
            self.tau,
        )

    def post_optimizer_hook(self, parts):
        return clip_hook(parts, self.names, self.heads, self.tau)


def head_slice(module: nn.Module) -> slice:
    """The heads this rank computes (its tensor-parallel rank's, all without TP), from how
    the query projection's rows are sharded over the mesh's "tp" dimension."""
    query = module.get_parameter(next(iter(module.qk_clip_scales(torch.ones(module.n_heads)))))
    if not isinstance(query, DTensor):
        return slice(0, module.n_heads)
    mesh = query.device_mesh
    if "tp" not in (mesh.mesh_dim_names or ()):
        return slice(0, module.n_heads)
    tp = mesh.mesh_dim_names.index("tp")
    heads = module.n_heads // mesh.size(tp)
    first = mesh.get_local_rank(tp) * heads
    return slice(first, first + heads)


def scale_rows_(param: torch.Tensor, factors: torch.Tensor) -> None:
    """param's row r *= factors[r] (global row numbers), on the rows this rank holds."""
    local = param
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        local, factors = param.to_local(), factors[offset[0] : offset[0] + shape[0]]
    local.mul_(factors.to(local.dtype).view(-1, *[1] * (local.dim() - 1)))


def clip_hook(parts: list[nn.Module], names: list[str], width: int, tau: float):
    rows = {name: i for i, name in enumerate(names)}
    local = [
        (rows[name], module, head_slice(module)) for p in parts for name, module in _tracked(p)
    ]
    device = next(p.device for part in parts for p in part.parameters())

    def after_step(taken: bool) -> dict:
        table = torch.full((len(names), width), float("-inf"), device=device)
        for row, module, heads in local:
            table[row, heads] = module.logit_max[: heads.stop - heads.start]
            module.logit_max.fill_(float("-inf"))
        if not taken:  # the weights did not move: nothing to clip
            return {}
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        over = table > tau
        gamma = torch.where(over, tau / table, torch.ones_like(table))
        with torch.no_grad():
            for row, module, _ in local:
                factors = module.qk_clip_scales(gamma[row, : module.n_heads])
                for name, rows_factors in factors.items():
                    scale_rows_(module.get_parameter(name), rows_factors)
        return {"qk_max": table.max(), "qk_clipped_heads": over.sum()}

    return after_step
