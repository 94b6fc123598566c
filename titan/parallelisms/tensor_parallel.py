"""Tensor parallelism (with optional sequence parallelism and loss parallelism).

`parallelize_transformer` applies the Megatron-style plan to any decoder that has
tok_embeddings / layers / norm / output, and blocks with attention(wq, wk, wv, wo),
feed_forward(w1, w2, w3), attention_norm and ffn_norm.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def parallelize_transformer(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                            loss_parallel: bool) -> None:
    # between blocks activations are sharded on the sequence (SP) or replicated
    between = Shard(1) if sequence_parallel else Replicate()
    top = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(between, None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(input_layouts=(between,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)

    if not sequence_parallel:
        # norms stay whole on every rank; as replicated DTensors they mix with the sharded
        # params in one foreach optimizer step and in the global grad-norm reduction
        for module in model.modules():
            if isinstance(module, nn.RMSNorm):
                distribute_module(module, tp_mesh, input_fn=_replicate_inputs,
                                  output_fn=_local_output)


def _replicate_inputs(module, inputs, mesh):
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if not isinstance(x, DTensor) else x for x in inputs)


def _local_output(module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output
