"""Activations and transient buffers of one rank, before the run: the rank's own model parts
(`titan.assembly.build.meta_parts`, under a fake process group) run one microbatch's forward on fake
tensors (shapes and dtypes, no memory, no data) through the trainer's own forward
(`titan.assembly.microbatch`), and `ActivationTracker` sums what is held for backward when it ends,
as it does in the run. So AC mode, sequence and context sharding, TP/SP and loss parallelism,
mixed precision and float8 act as they will.

A pipeline rank holds several microbatches at once: the count comes from torch's own action
list for the schedule (`pipeline_order`), walked in order: a forward adds that stage's
microbatch, a full or weight backward removes it but for its output when something keeps that
longer: under the multi-stage schedules (Interleaved1F1B, ZBV...) every sending stage's until
the step ends, as a V schedule's turning stage's (the next stage, on the same rank, holds it
as its input); one output of a 1F1B stage (the last stage: one input gradient sent back). No
stage keeps outputs for the schedule to return: the trainer asks for none.
A zero-bubble schedule splits a backward into an input part (I) and a weight part (W): the I
frees the graph above the weights' uses (the last stage's loss and logits), keeps the
gradients at the intermediates the W starts from until that W, and leaves the input's gradient
on the stage's input until the step ends; each is traced with torch's own input backward.
Its receive buffers (one per microbatch, for activations and for gradients) are added; a V
schedule's same-rank stages replace theirs with each other's tensors as they go.

Transient buffers are estimated, not traced: FSDP's all-gathered parameters (the largest unit
and the next one prefetched, plus units kept unsharded: the last, or all of them under
pipelining) and the reduce-scatter input of the largest unit's gradients, the logits'
gradient, and expert parallelism's reordering buffers of one MoE layer.

Expert parallelism's dispatch is traced with every rank receiving an even share of the rows
(balanced routing). Its bound (`worst_routing_bytes` of titan.planner.memory) is a second
trace in which each rank receives every row of its ep group in every MoE layer: no routing
can send a rank more. Compiled code is traced eagerly: compile tends to save less, so the figure
is an upper bound with `compile.enable`.
"""

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from titan.components.data.batch import sample
from titan.components.observability.memory_measure import ActivationTracker, storages
from titan.config import JobConfig
from titan.models.common.aux_loss import AuxLossCollector
from titan.runtime.dtypes import to_dtype


def trace_activations(
    job: JobConfig, plan, parts: list[nn.Module], pp_plan, worst_routing: bool = False
) -> tuple[dict, "PipelineHeld | None"]:
    """({"activations_bytes", "transient_bytes"} of one rank at its peak, what its pipeline
    stages hold (None without pipelining)), from its meta parts built under a fake process
    group (titan.planner.memory.rank_bytes). Materializes them as fake tensors.
    `worst_routing`: the parts' experts dispatch the worst case (expert_parallel.
    worst_case_routing), and the dispatch buffers are counted for it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan.assembly.microbatch import ForwardBackward

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # a failed trace is reported once, by the caller
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            for part in parts:
                part.to_empty(device="cpu")  # fake: shapes only
                part.train()
            fb = ForwardBackward(job, plan, parts, pp_plan, torch.device("cpu"))
            held = None
            if pp_plan is None:
                t = job.training
                acts, _, _ = _forward_held(fb, parts, 0, t.local_batch_size, t.seq_len)
                logits = _output_bytes(parts[0], t.local_batch_size, t.seq_len // plan.dims.cp, fb)
            else:
                held, logits = _pipeline_held(fb, parts, pp_plan, plan)
                acts = held.activations_bytes(plan.dims["pp"].get_local_rank(), pp_plan.stage_ids)
    finally:
        fake_log.setLevel(level)
    return {
        "activations_bytes": acts,
        "transient_bytes": fsdp_transient_bytes(parts, job)
        + logits
        + dispatch_transient_bytes(job, plan, fb, worst_routing),
    }, held


def _forward_held(
    fb,
    parts: list[nn.Module],
    index: int,
    batch: int,
    seq_len: int,
    hidden: torch.Tensor | None = None,
    split: bool = False,
) -> tuple[int, int, tuple[int, int]]:
    """(bytes held for backward, bytes of the output, (bytes an input-only backward keeps
    for the weight backward, bytes of the held ones it frees)) after one forward of
    parts[index] on `batch` sequences: from tokens, or from `hidden` (a later pipeline stage).
    The last pair is traced with `split` (a zero-bubble schedule's later stage), else 0s."""
    part = parts[index]
    tokens = torch.randint(0, 2, (batch, seq_len))
    labels = torch.randint(0, 2, (batch, seq_len))
    tracker = ActivationTracker(parts)
    # as in a training step: auxiliary losses (an MoE's balancing, multi-token prediction)
    # ride on the activations and keep their graphs for backward
    # the fields the objective's terms read ride with the labels: zeros stand for them
    mb = sample(tokens, labels, **{f: torch.zeros_like(labels) for f in fb.objective.fields})
    if fb.job.training.dataset_format == "images":  # the heaviest images a window can hold
        from titan.components.data.image_text import planning_fields

        mb.update(planning_fields(fb.plan.model_args.vision, batch, seq_len))
    kwargs, target = fb.model_kwargs(mb), fb.objective.target(mb)
    with (
        tracker,
        AuxLossCollector(1.0),
        fb.cp_ctx(tokens, target, kwargs=kwargs),
        fb.loss_parallel_ctx(),
    ):
        if fb.pp_plan is None:
            out = loss = fb.forward_loss(mb, kwargs, target)
        else:
            out = part(tokens if hidden is None else hidden, **kwargs)
            # the schedule keeps each loss (and so its graph) until the step ends
            loss = fb.objective.loss(out, target) if part.output is not None else None
        held = tracker.held_bytes()
        out_bytes = sum(s.nbytes() for s in storages(out))
        split_bytes = (0, 0)
        if split and hidden is not None:
            if loss is not None:
                # the last stage keeps its loss for the weight backward, not its logits
                out = None
            kept, after = _input_backward(part, out if loss is None else loss, hidden, tracker)
            split_bytes = (kept, held - after)
    del loss
    return held, out_bytes, split_bytes


def _input_backward(part: nn.Module, out: torch.Tensor, hidden: torch.Tensor, tracker):
    """torch's input-only backward of a stage (its zero-bubble I): (the bytes of the gradients
    it keeps for the weight backward, at the intermediates that one starts from; the bytes the
    forward's graph holds after it: it frees the part above those intermediates)."""
    from torch.distributed.pipelining._backward import stage_backward_input
    from torch.utils._pytree import tree_leaves

    grads = None if out.dim() == 0 else [torch.empty_like(out)]  # a receive buffer's
    _, groups = stage_backward_input([out], grads, [hidden], part.parameters())
    hidden.grad = _ = None  # the input's gradient: the walk's own term
    # while `groups` keeps the rest of the graph; the buffer is counted as one
    after = tracker.held_bytes() - sum(s.nbytes() for g in grads or () for s in storages(g))
    kept = {
        s._cdata: s.nbytes()
        for t in tree_leaves([g.get("grads") for g in groups])
        if isinstance(t, torch.Tensor)
        for s in storages(t)
    }
    return sum(kept.values()), after


def _output_bytes(part: nn.Module, batch: int, seq_len: int, fb) -> int:
    """The logits this part makes at once (their gradient is as big), or 0: the whole
    microbatch's, or one chunk's under a chunked loss."""
    if part.output is None:
        return 0
    vocab = fb.plan.model_args.vocab_size // (fb.plan.dims.tp if fb.loss_parallel else 1)
    tokens = batch * seq_len
    chunk = fb.job.training.loss_chunk_tokens
    return (min(tokens, chunk) if chunk else tokens) * vocab * _act_dtype(fb).itemsize


def _act_dtype(fb) -> torch.dtype:
    t, dims = fb.job.training, fb.plan.dims
    # FSDP computes in its param dtype; without it, bf16 comes from autocast (not in pipelines)
    if dims.fsdp_enabled or (fb.schedule is None and t.mixed_precision_param == "bfloat16"):
        return to_dtype(t.mixed_precision_param)
    return torch.float32


@dataclass
class PipelineHeld:
    """What a pipeline rank's stages hold, by their position in its stage list: per
    microbatch until its backward, the output, what an input-only backward keeps for the
    weight backward, the receive buffers; and every pipeline rank's actions, in order (torch's
    schedule plans them all). A rank whose stages have the same structure holds the same per
    microbatch, but walks its own actions: 1F1B's ranks keep different counts of microbatches
    in flight."""

    per_mb: tuple[int, ...]
    outputs: tuple[int, ...]
    # what an input-only backward (I) keeps until its W, and what it frees of per_mb
    split_kept: tuple[tuple[int, int], ...]
    buffers: int
    input_grad: int  # a stage's gradient of its input (one hidden state)
    num_stages: int
    multi_stage: bool
    orders: dict

    def activations_bytes(self, pp_rank: int, stage_ids: tuple[int, ...]) -> int:
        """Pipeline rank `pp_rank`'s peak, its stages `stage_ids` alike to the traced ones."""
        last, hidden = self.num_stages - 1, self.input_grad
        holds = {}
        for sid, per_mb, output, split in zip(
            stage_ids, self.per_mb, self.outputs, self.split_kept
        ):
            hold = StageHold(per_mb, split_kept=split[0], split_freed=split[1])
            if sid > 0:
                hold.input_grad = hidden  # an I leaves it on the input until the step ends
            if sid + 1 in stage_ids:
                # a V schedule's turn: the next stage takes this output as its input (its
                # receive buffer, freed) and holds it until the step ends; its backward hands
                # back the gradient in place of this stage's gradient buffer
                hold.kept = output
            elif sid != last and self.multi_stage:
                hold.kept = output  # multi-stage schedules await their sends when the step ends
            elif not self.multi_stage:
                # 1F1B's loop holds the work of its last fired warmup send, and with it that
                # output, until its steady phase ends; the last stage's, the gradient it sent
                hold.kept, hold.keep_one = (hidden if sid == last else output), True
            if sid - 1 in stage_ids:
                hold.replaces = hidden
            holds[sid] = hold
        return self.buffers + peak_in_flight(self.orders[pp_rank], holds)


@dataclass
class StageHold:
    """One stage's bytes in the walk over its rank's actions."""

    per_mb: int  # held from a microbatch's forward until its full or weight backward
    kept: int = 0  # of it, what outlives that backward until the step ends
    keep_one: bool = False  # only the first backward keeps `kept`
    split_kept: int = 0  # made by an input-only backward (I), freed by its weight backward (W)
    split_freed: int = 0  # of per_mb, what the I frees (the graph above the weights' uses)
    input_grad: int = 0  # made by an I and left on the stage's input until the step ends
    # a receive buffer of this stage and one of the previous stage that the previous stage's
    # output and this stage's input gradient replace (same-rank stages): freed at forward and
    # at I; a full backward's gradient is held in the buffer's place
    replaces: int = 0


def peak_in_flight(actions: list, holds: dict[int, StageHold]) -> int:
    """The most bytes a pipeline rank holds at once, walking its actions in the schedule's
    order (the moments a backward begins: after each forward and input-only backward)."""
    held = peak = 0
    kept_once = set()
    for action in actions:
        kind, sid = action.computation_type.value, action.stage_index
        h = holds[sid]
        if kind == "F":
            held += h.per_mb - h.replaces
        elif kind == "I":
            held += h.split_kept + h.input_grad - h.replaces - h.split_freed
        elif kind in ("B", "W"):
            keep = h.kept if not (h.keep_one and sid in kept_once) else 0
            kept_once.add(sid)
            split = h.split_kept - h.split_freed if kind == "W" else 0
            held -= h.per_mb - keep + split
        peak = max(peak, held)
    return peak


def _pipeline_held(fb, parts, pp_plan, plan) -> tuple[PipelineHeld, int]:
    t, dims, args = fb.job.training, plan.dims, plan.model_args
    mb = t.local_batch_size // pp_plan.n_microbatches
    seq = t.seq_len // dims.cp
    # stages pass local tensors: sequence-parallel ones hold 1/tp of the sequence
    hidden_seq = (
        seq // dims.tp if dims.tp_enabled and fb.job.parallelism.enable_sequence_parallel else seq
    )
    hidden_bytes = mb * hidden_seq * args.dim * _act_dtype(fb).itemsize
    per_mb, outputs, split_kept, buffers, logits = [], [], [], 0, 0
    orders = {rank: list(_flat(actions)) for rank, actions in fb.schedule.pipeline_order.items()}
    splits = {
        a.stage_index for acts in orders.values() for a in acts if a.computation_type.value == "I"
    }
    for i, sid in enumerate(pp_plan.stage_ids):
        hidden = None
        if sid > 0:
            hidden = torch.empty(mb, hidden_seq, args.dim, dtype=_act_dtype(fb), requires_grad=True)
            buffers += pp_plan.n_microbatches * hidden_bytes  # activation receive buffers
        if sid < pp_plan.num_stages - 1:
            buffers += pp_plan.n_microbatches * hidden_bytes  # gradient receive buffers
        held, out, split = _forward_held(fb, parts, i, mb, t.seq_len, hidden, sid in splits)
        per_mb.append(held)
        outputs.append(out)
        split_kept.append(split)
        logits = max(logits, _output_bytes(parts[i], mb, seq, fb))
    return PipelineHeld(
        tuple(per_mb),
        tuple(outputs),
        tuple(split_kept),
        buffers,
        hidden_bytes,
        pp_plan.num_stages,
        not isinstance(fb.schedule, PipelineScheduleSingle),
        orders,
    ), logits


def _flat(actions):
    for a in actions:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        if subs:
            yield from _flat(subs)
        else:
            yield a


def dispatch_transient_bytes(job: JobConfig, plan, fb, worst_routing: bool = False) -> int:
    """Expert parallelism's buffers in one MoE layer that backward does not keep: the rows as
    received before their reordering, and the experts' outputs reordered before they go back.
    Balanced routing; under `worst_case_routing`, every row of the ep group (ep x as many)."""

    d, t = plan.dims, job.training
    if not d.ep_enabled:
        return 0
    batch = (
        t.local_batch_size
        if fb.pp_plan is None
        else job.parallelism.pipeline_parallel_microbatch_size
    )
    split = d.cp * (d.tp if job.parallelism.enable_sequence_parallel else 1)
    rows = batch * t.seq_len // split * plan.model_args.moe.top_k
    if worst_routing:
        rows *= d.ep
    return 2 * rows * plan.model_args.dim * _act_dtype(fb).itemsize


def fsdp_transient_bytes(parts: list[nn.Module], job: JobConfig) -> int:
    """FSDP's all-gathered parameters at their peak and one unit's gradients before the
    reduce-scatter: units that reshard after forward hold two at once (one prefetched),
    the others (the last unit, or all under pipelining) stay gathered."""
    from torch.distributed.fsdp import FSDPModule

    t = job.training
    param_size, reduce_size = (
        to_dtype(t.mixed_precision_param).itemsize,
        to_dtype(t.mixed_precision_reduce).itemsize,
    )
    resharding, kept, units = [], 0, []
    for part in parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            numel = (
                sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
                * group.mesh_info.shard_mesh_size
            )
            units.append(numel)
            if group.post_forward_mesh_info is None:
                kept += numel
            else:
                resharding.append(numel)
    if not units:
        return 0
    biggest = sorted(resharding, reverse=True)[:2]
    return (sum(biggest) + kept) * param_size + max(units) * reduce_size
