"""The generic parallelize policy for a `Decoder` (titan.models.common.decoder) part:
TP -> EP -> AC -> compile -> FSDP/DDP, which a family's `parallelize_fn` assembles.

Context parallelism is not applied here: it shards each batch (and the model's `cp_buffers`)
inside the trainer's forward/backward context. The TP plan names the common blocks'
submodules; a family with another FFN passes its own `ffn_plan`.
"""

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan.models.common.moe import MoE
from titan.models.common.vision_parallelize import tower_tp
from titan.parallelisms.activation_checkpoint import apply_ac
from titan.parallelisms.compile import compile_blocks, compile_whole
from titan.parallelisms.data_parallel import apply_ddp, apply_fsdp, reshard_after_forward
from titan.parallelisms.expert_parallel import ExpertParallel
from titan.parallelisms.parallel_dims import ParallelDims
from titan.parallelisms.tensor_parallel import (
    LocalTokens,
    place_low_rank_factors,
    replicate_modules,
)
from titan.runtime.dtypes import to_dtype

# between blocks, activations are Shard(1) on the sequence (SP) or Replicate(): a plan of the
# module names in one block -> its ParallelStyle, given that layout (and, for an attention
# plan, the block's attention module)
BlockPlan = Callable[[Shard | Replicate], dict]
AttentionPlan = Callable[[Shard | Replicate, nn.Module], dict]
# a family's plan for modules the common ones do not name (module paths within the model part,
# e.g. DeepSeek-V3's prediction depths' merging projection), given the part and the layout
PartPlan = Callable[[nn.Module, Shard | Replicate], dict]


def swiglu_ffn_plan(between) -> dict:
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
        "feed_forward.w3": ColwiseParallel(),
    }


def moe_plan(between, moe: MoE, *, expert_parallel: bool = False) -> dict:
    """Shared experts tensor-parallel like a dense FFN; the router and the routed experts
    whole on every rank, each over its own tokens (sequence-split with SP), their gradients
    summed over the ranks. Expert parallelism, not TP, is what splits routed experts: with it
    on, the routed experts are left to `ExpertParallel` on the (ep, tp) mesh."""
    sequence_parallel = isinstance(between, Shard)
    plan = {
        "feed_forward": PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(between,), use_local_output=True
        ),
        "feed_forward.router.gate": LocalTokens(sum_grads=sequence_parallel),
    }
    if not expert_parallel:
        plan["feed_forward.experts"] = LocalTokens(sum_grads=sequence_parallel)
    if moe.shared_experts is not None:
        plan.update(
            {
                "feed_forward.shared_experts": PrepareModuleInput(
                    input_layouts=(between,), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.shared_experts.w1": ColwiseParallel(),
                "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=between),
                "feed_forward.shared_experts.w3": ColwiseParallel(),
            }
        )
    return plan


def attention_plan(between, attention: nn.Module) -> dict:
    """Grouped-query attention (titan.models.common.attention): heads split over the ranks."""
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
    }
    if attention.q_norm is not None:
        # each rank normalizes its own heads (dim 2 of (batch, seq, heads, head_dim)); the
        # weight is replicated and its gradient summed over the heads of every rank
        plan.update(
            {
                "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            }
        )
    return plan


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    ffn_plan: BlockPlan = swiglu_ffn_plan,
    attention_plan: AttentionPlan = attention_plan,
    part_plan: PartPlan | None = None,
    expert_parallel: bool = False,
) -> None:
    """Megatron-style TP: heads and FFN width split, norms (and residuals) sequence-split."""
    between = Shard(1) if sequence_parallel else Replicate()
    tied = _tied(model)
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        # each style made its own Shard(0) parameter: one matrix again before FSDP, which
        # would otherwise hold it in two units (one all-gathering a stale copy where a rank's
        # shard is padded: a vocabulary the ranks do not divide)
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        ffn = (
            moe_plan(between, block.feed_forward, expert_parallel=expert_parallel)
            if isinstance(block.feed_forward, MoE)
            else ffn_plan(between)
        )
        plan = {**attention_plan(between, block.attention), **ffn}
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    extra = part_plan(model, between) if part_plan is not None else {}
    if extra:
        parallelize_module(model, tp_mesh, extra)
    tower_tp(model, tp_mesh, sequence_parallel)
    place_low_rank_factors(model, tp_mesh)  # adapters beside the weights they update
    if not sequence_parallel:  # the norms not split above
        replicate_modules(
            [
                m
                for m in model.modules()
                if isinstance(m, nn.RMSNorm) and not isinstance(m.weight, DTensor)
            ],
            tp_mesh,
        )


def _tied(model: nn.Module) -> bool:
    """Whether this part holds the embedding and the output as one parameter."""
    return (
        model.tok_embeddings is not None
        and model.output is not None
        and model.output.weight is model.tok_embeddings.weight
    )


def _embedding_used_late(model: nn.Module) -> bool:
    """Whether the model uses its embedding again after the blocks (tied to the output, or
    shared with later modules such as DeepSeek-V3's prediction depths)."""
    return model.tok_embeddings is not None and any(
        owner == "tok_embeddings.weight" for owner, _ in model.tied_parameters()
    )


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    job,
    *,
    ffn_plan: BlockPlan = swiglu_ffn_plan,
    attention_plan: AttentionPlan = attention_plan,
    part_plan: PartPlan | None = None,
) -> nn.Module:
    par, training = job.parallelism, job.training
    # frozen weights (LoRA's base) stay frozen: some of torch's styles make new parameters
    # that require gradients (SequenceParallel's norms)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if dims.tp_enabled:
        apply_tp(
            model,
            dims["tp"],
            sequence_parallel=par.enable_sequence_parallel,
            loss_parallel=not par.disable_loss_parallel,
            ffn_plan=ffn_plan,
            attention_plan=attention_plan,
            part_plan=part_plan,
            expert_parallel=dims.ep_enabled,
        )
    experts = (
        [b.feed_forward.experts for b in model.layers.values() if isinstance(b.feed_forward, MoE)]
        if dims.ep_enabled
        else []
    )
    for module in experts:
        parallelize_module(
            module,
            dims["ep_etp" if dims.tp_enabled else "ep"],
            ExpertParallel(sum_tp_grads=par.enable_sequence_parallel),
        )
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    side = model.side_blocks()
    for stack in (model.layers, *side):
        apply_ac(stack, job.activation_checkpoint)
    if job.compile.enable:
        # per-block compile + TP breaks in backward on CPU (torch 2.13): compile the whole model
        if dims.tp_enabled and dims.device_type == "cpu":
            compile_whole(model, job.compile.backend)
        else:
            moe = any(isinstance(b.feed_forward, MoE) for b in model.layers.values())
            compile_blocks(model.layers, job.compile.backend, fullgraph=not moe)
            for stack in side:
                compile_blocks(stack, job.compile.backend, fullgraph=False, dynamic=True)
    # torchft averages gradients across replica groups in FSDP's all-reduce hook
    if dims.fsdp_enabled or job.fault_tolerance.enable:
        mesh_dims = ("dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else ("dp_shard_cp",)
        # a tied matrix is used first and last: the root unit holds it for the whole step
        tied = _tied(model)
        head = [m for m in (model.norm, None if tied else model.output) if m is not None]
        first = None if _embedding_used_late(model) else model.tok_embeddings
        apply_fsdp(
            model,
            dims[mesh_dims],
            units=[
                m
                for m in (first, *(b for s in side for b in s.values()), *model.layers.values())
                if m is not None
            ],
            final_unit=head,
            param_dtype=to_dtype(training.mixed_precision_param),
            reduce_dtype=to_dtype(training.mixed_precision_reduce),
            reshard=reshard_after_forward(par.fsdp_reshard_after_forward, dims.pp_enabled),
            cpu_offload=training.enable_cpu_offload,
            expert_units=experts,
            expert_mesh=dims["edp" if dims.dp_replicate > 1 else "efsdp"] if experts else None,
        )
    elif dims.dp_replicate > 1:
        apply_ddp(model, dims["dp_replicate"])
    return model
