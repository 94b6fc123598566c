"""The tensor-parallel plan of multi-head latent attention (titan.models.deepseek_v3.mla):
heads split over the ranks as in Megatron; the latent projections and norms, whose width is
not per head, whole on every rank over the gathered tokens."""

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan.parallelisms.tensor_parallel import LocalTokens, SumInputGrads


def mla_plan(between, attention: nn.Module) -> dict:
    # every rank sees every token of the block (gathered here under SP) with whole latent
    # weights: their gradients are whole on each rank once the heads' shares are summed, which
    # the colwise projections do for their inputs and SumInputGrads for the shared rotated key
    whole = LocalTokens(sum_grads=False)
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(between, None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        ),
        "attention.wkv_a": whole,
        "attention.kv_norm": whole,
        "attention.wkv_b": ColwiseParallel(),
        "attention.rope_key": SumInputGrads(),
        "attention.wo": RowwiseParallel(output_layouts=between),
    }
    if hasattr(attention, "wq_a"):
        plan.update(
            {
                "attention.wq_a": whole,
                "attention.q_norm": whole,
                "attention.wq_b": ColwiseParallel(),
            }
        )
    else:
        plan["attention.wq"] = ColwiseParallel()
    return plan
