"""Token dropping for an MoE layer with a capacity factor (Megatron's moe_expert_capacity_factor
with its two drop policies, and padding to capacity).

The routing group is a sequence, or this rank's part of it where context or sequence
parallelism splits sequences: within a group each expert takes at most `capacity` of the
token choices routed to it. Which ones: its highest routing weights ("probs"; equal weights by
position) or the group's earliest tokens ("position"). Everything is computed on the device,
with shapes that do not depend on the routing: no value is read on the host.
"""

import torch


def choice_ranks(
    weights: torch.Tensor, indices: torch.Tensor, group_tokens: int, n_experts: int, policy: str
) -> torch.Tensor:
    """Each token choice's place (0 first) among the choices of its routing group that chose the
    same expert, in the order the policy keeps them. weights, indices: (tokens, k), the tokens
    of whole groups of `group_tokens` in order; returns (tokens x k,) int64 in choice order."""
    n_tokens, k = indices.shape
    n = n_tokens * k
    device = indices.device
    choice = torch.arange(n, device=device)
    key = (choice // (group_tokens * k)) * n_experts + indices.reshape(-1)
    if policy == "probs":
        # stable sorts: by weight (highest first, equal ones by position), then by group and
        # expert keeping that order within each
        first = torch.argsort(-weights.detach().reshape(-1), stable=True)
        order = first[torch.argsort(key[first], stable=True)]
    else:
        order = torch.argsort(key, stable=True)
    n_keys = (n_tokens // group_tokens) * n_experts
    per_key = torch.zeros(n_keys, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key)
    )
    starts = per_key.cumsum(0) - per_key
    ranked = choice - starts[key[order]]  # place within its (group, expert) run
    return torch.empty_like(ranked).scatter_(0, order, ranked)


def padded_slots(
    indices: torch.Tensor,
    ranks: torch.Tensor,
    kept: torch.Tensor,
    group_tokens: int,
    n_experts: int,
    capacity: int,
) -> torch.Tensor:
    """Each choice's row in the padded expert input: expert e's block holds, group by group,
    `capacity` rows each (kept choices first, zero rows after); a dropped choice gets the
    extra row past the end, which no expert sees."""
    k = indices.shape[1]
    groups = indices.shape[0] // group_tokens
    group = torch.arange(ranks.numel(), device=ranks.device) // (group_tokens * k)
    slot = (indices.reshape(-1) * groups + group) * capacity + ranks
    return torch.where(kept, slot, n_experts * groups * capacity)
