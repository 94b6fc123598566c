"""The tensor-parallel plans of multi-head latent attention (titan.models.deepseek_v3.mla):
heads split over the ranks as in Megatron; the latent projections and norms, whose width is
not per head, whole on every rank over the gathered tokens. And of the multi-token-prediction
depths' own parts (titan.models.deepseek_v3.mtp): norms sequence-split like the blocks', the
merging projection whole on each rank's tokens; a pipeline stage's own copy of the embedding
split like the embedding."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

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


def mtp_plan(model: nn.Module, between) -> dict:
    sequence_parallel = isinstance(between, Shard)
    plan = {}
    if model.tok_embeddings is None and model.mtp_embeddings is not None:
        plan["mtp_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    for i in model.layers:
        if int(i) < model.args.n_layers:
            continue
        # each rank merges its own tokens' two halves with the whole projection
        plan[f"layers.{i}.eh_proj"] = LocalTokens(sum_grads=sequence_parallel)
        if sequence_parallel:
            plan[f"layers.{i}.enorm"] = SequenceParallel(use_local_output=True)
            plan[f"layers.{i}.hnorm"] = SequenceParallel(use_local_output=True)
            plan[f"layers.{i}.head_norm"] = SequenceParallel()
    return plan
