"""GPT-OSS's tensor-parallel attention plan: the common one (heads split over the ranks,
biases with their rows) with each head's sink logit on the rank that holds the head."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput

from titan.models.common.parallelize import attention_plan
from titan.parallelisms.tensor_parallel import local_in_forward


class SinksWithHeads(PrepareModuleInput):
    """The attention module's input gathered as PrepareModuleInput does, and its `sinks`
    (one per head) sharded like the heads: a Shard(0) DTensor that steps and checkpoints with
    the rest, and within forward each rank's own sinks as a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        module.sinks = nn.Parameter(distribute_tensor(module.sinks.data, device_mesh, [Shard(0)]))
        local_in_forward(module, names=("sinks",))
        return module


def sink_attention_plan(between, attention: nn.Module) -> dict:
    plan = attention_plan(between, attention)
    prepare = plan["attention"]
    plan["attention"] = SinksWithHeads(
        input_layouts=prepare.input_layouts, desired_input_layouts=prepare.desired_input_layouts
    )
    return plan
