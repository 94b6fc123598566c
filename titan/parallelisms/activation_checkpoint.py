"""Activation checkpointing of transformer blocks: full, every N-th block, or per op."""

import contextlib
import threading
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# outputs worth keeping: expensive to recompute, cheap to store relative to their cost
_SAVE_LIST = {
    _aten.mm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    # an MoE's routed experts (all three of their products) and its routing: the choice and
    # the sort by expert, small, and kept so that backward routes as forward did
    _aten._grouped_mm.default,
    _aten.topk.default,
    _aten.sort.stable,
}
# titan's own ops, by name (registered by the modules that define them, which need not be
# imported here): attention written out (masks, sinks), the experts' compiled CPU GEMM, the
# ring form of attention under context parallelism (every rank's keys) and CP's exchanges of
# q, k, v and outputs; recompute would run them (and wait on peers) again
_SAVE_NAMES = {
    "titan::masked_attention",
    "titan::grouped_mm",
    "titan::ring_masked_attention",
    "titan::cp_all_to_all",
    "titan::cp_all_gather",
}


_cheap = threading.local()


@contextlib.contextmanager
def recomputed_in_backward():
    """Ops run inside are recomputed under per-op AC, never saved, and leave the matmul count
    alone: for products cheap to run again whose outputs are as large as the layer's (a
    low-rank update's: rank r inner dimension), saving would cost the layer's memory again.
    The flag is per thread: backward's recompute runs the same code on its own thread."""
    before = getattr(_cheap, "on", False)
    _cheap.on = True
    try:
        yield
    finally:
        _cheap.on = before


def op_policy():
    """A policy for one checkpointed region: save every other matmul (halves the stored
    matmul outputs at a fraction of the recompute) and the ops of _SAVE_LIST.

    Each region counts its own matmuls, in forward and in recompute alike: torch <= 2.12 asks
    the policy again during recompute, and a count carried over from another region (blocks
    recompute in reverse order) would pop another matmul's saved output: a wrong-shaped
    tensor (seen on CUDA with torch 2.11, DeepSeek-V3) or, with equal shapes, a silently wrong
    gradient."""
    counts = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        if getattr(_cheap, "on", False):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op == _aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return (
                CheckpointPolicy.MUST_SAVE
                if counts[key] % 2 == 0
                else CheckpointPolicy.PREFER_RECOMPUTE
            )
        saved = op in _SAVE_LIST or op.name() in _SAVE_NAMES
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_policy_context():
    return create_selective_checkpoint_contexts(op_policy())


def apply_ac(layers: nn.ModuleDict, cfg) -> None:
    """Wrap blocks in place per `cfg` (the activation_checkpoint section, validated by the
    config: selective_ac_option is 'op' or a positive integer); non-reentrant wrappers keep
    state-dict keys unchanged."""
    if cfg.mode == "none":
        return
    every = 1
    context_fn = None
    if cfg.mode == "selective":
        if cfg.selective_ac_option == "op":
            context_fn = _op_policy_context
        else:
            every = int(cfg.selective_ac_option)
    for i, (name, block) in enumerate(list(layers.items())):
        if i % every:
            continue
        kw = {"context_fn": context_fn} if context_fn else {}
        layers[name] = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False, **kw
        )
