"""Expert parallelism: an MoE's routed experts sharded over the ep ranks, each holding
n_experts / ep of them, and every token sent to the rank holding its expert and back.

Applied to the routed-experts module (titan.models.common.moe.GroupedExperts) from outside:
its input is the tokens of this rank sorted by expert with the count per expert; a forward
pre-hook sends each expert's rows to its rank with one all-to-all (the counts go first, in
another), orders the rows it received by local expert, and hands the module its own experts'
weights; the forward hook sends the outputs back the same way, so the model sees its own
tokens' outputs in the order it sent them. torch's autograd all-to-all carries the gradients
back along the same routes.

Each rank's loss is the mean over its own tokens, and data parallelism averages gradients over
the ranks. An expert's gradient on its rank sums what every ep rank's tokens contribute, so
the style divides it by ep; FSDP then averages it over the ranks holding the same experts
(efsdp, and HSDP's replicas): over all data-parallel ranks in all, like a dense weight's.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.profiler import record_function

# the forward's spans in profiler traces (the backward's all-to-alls show as autograd's
# all_to_all_single nodes)
DISPATCH, COMBINE = "expert_parallel.dispatch", "expert_parallel.combine"


class ExpertParallel(ParallelStyle):
    """`module` holds stacked expert weights (experts, ...) and is called as
    module(rows sorted by expert, counts per expert); rows past the last expert's (choices
    dropped for capacity) are not sent, and come back as zeros.

    `device_mesh` is the 1-D ep mesh, or (ep, tp) under tensor parallelism: then each tp rank
    dispatches its own tokens within its ep group and the experts are whole on the tp ranks,
    their gradients summed over them with `sum_tp_grads` (sequence parallelism: each tp rank
    routed other tokens), as `LocalTokens` does for a module that TP leaves whole."""

    def __init__(self, sum_tp_grads: bool = False):
        super().__init__()
        self.tp_grad = Partial() if sum_tp_grads else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ep_mesh = (
            device_mesh if device_mesh.ndim == 1 else device_mesh[device_mesh.mesh_dim_names[0]]
        )
        ep = ep_mesh.size()
        placements = [Shard(0)] + [Replicate()] * (device_mesh.ndim - 1)
        grad_placements = [Shard(0)] + [self.tp_grad] * (device_mesh.ndim - 1)
        for name, p in list(module.named_parameters(recurse=False)):
            if p.shape[0] % ep:
                raise ValueError(f"{p.shape[0]} experts do not split over {ep} ep ranks")
            module.register_parameter(
                name,
                nn.Parameter(
                    distribute_tensor(p, device_mesh, placements, src_data_rank=None),
                    requires_grad=p.requires_grad,
                ),
            )
        routes: list[_Route] = []
        swapped: list[tuple[str, nn.Parameter]] = []
        setattr(module, WORST_CASE, False)

        def dispatch(mod, args):
            x, counts = args
            with record_function(DISPATCH):
                route = _Route(counts, ep_mesh, x.shape[0], getattr(mod, WORST_CASE))
                routes.append(route)
                for name, p in list(mod._parameters.items()):
                    if isinstance(p, DTensor):
                        swapped.append((name, p))
                        # this rank's experts, their gradient divided by ep on its way back
                        local = p.to_local(grad_placements=grad_placements)
                        mod._parameters[name] = _ScaleGrad.apply(local, 1.0 / ep)
                return route.send(x), route.local_counts

        def combine(mod, args, out):
            with record_function(COMBINE):
                while swapped:
                    name, p = swapped.pop()
                    mod._parameters[name] = p
                return routes.pop().receive(out)

        # outside torch.compile's graphs: the splits are host values, and the parameter slots
        # are rewritten
        module.register_forward_pre_hook(torch.compiler.disable(dispatch))
        module.register_forward_hook(torch.compiler.disable(combine))
        return module


# the experts module's flag that its traced dispatch gives this rank the worst case
WORST_CASE = "ep_worst_case_routing"


@contextlib.contextmanager
def worst_case_routing(parts: list[nn.Module]):
    """Within it, a traced (fake) dispatch of these parts' experts gives this rank every row
    its ep group routes: the most an imbalanced routing can send one rank, which the memory
    planner states as a bound."""
    experts = [m for part in parts for m in part.modules() if hasattr(m, WORST_CASE)]
    for m in experts:
        setattr(m, WORST_CASE, True)
    try:
        yield
    finally:
        for m in experts:
            setattr(m, WORST_CASE, False)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _Route:
    """Where this rank's sorted rows go and where the rows it receives came from."""

    def __init__(self, counts: torch.Tensor, mesh: DeviceMesh, rows: int, worst_case: bool):
        self.group = mesh.get_group()
        self.rows = rows
        ep = mesh.size()
        n_local = counts.numel() // ep
        sent = counts.view(ep, n_local)  # rows for (destination rank, its local expert)
        if is_fake(counts):
            # the planner's trace holds no values: every rank sends and receives its rows
            # evenly, the bytes of a balanced routing; or, for its bound, this rank receives
            # every row of its ep group
            self.send_splits = [rows // ep + (r < rows % ep) for r in range(ep)]
            received = sent * ep if worst_case else sent
            self.recv_splits = [rows] * ep if worst_case else self.send_splits
        else:
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, group=self.group)
            # the one host read of an MoE layer under ep: the all-to-all's split sizes
            splits = torch.stack([sent.sum(dim=1), received.sum(dim=1)]).tolist()
            self.send_splits, self.recv_splits = splits
        self.local_counts = received.sum(dim=0)
        # received rows are ordered by (source rank, local expert): the grouped GEMM needs them
        # by (local expert, source rank)
        block = torch.arange(ep * n_local, device=counts.device).repeat_interleave(
            received.reshape(-1), output_size=sum(self.recv_splits)
        )
        source, expert = block // n_local, block % n_local
        self.order = torch.argsort(expert * ep + source, stable=True)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        x = x[: sum(self.send_splits)]  # rows past the experts' (dropped choices) stay here
        rows = funcol.all_to_all_single_autograd(x, self.recv_splits, self.send_splits, self.group)
        return rows[self.order]

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        back = torch.empty_like(out).index_copy(0, self.order, out)
        back = funcol.all_to_all_single_autograd(
            back, self.send_splits, self.recv_splits, self.group
        )
        missing = self.rows - back.shape[0]  # the dropped rows' outputs: masked by the layer
        return torch.cat([back, back.new_zeros(missing, back.shape[1])]) if missing else back
