"""Mixture-of-experts feed-forward: a router picks each token's top-k experts, the routed
experts (stacked 3-D SwiGLU weights) run over the tokens sorted by expert, and shared experts
(when there are any) see every token. Dropless by default: every token reaches all k of its
experts, however unevenly they are chosen; with a capacity factor an over-full expert drops
choices (titan.models.common.moe_capacity).

Routers: softmax top-k with optional renormalization of the k weights (Qwen3-MoE), and
sigmoid scores with group-limited top-k, a score-correction bias that steers the choice but
not the weights, and a scaling factor (DeepSeek-V3). transformers' implementations are the
reference for the numerics (tests/unit/test_moe.py compares the two).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from titan.models.common.aux_loss import TokenSplit, attach_group_loss, collecting, token_split
from titan.models.common.feed_forward import FeedForward
from titan.models.common.grouped_mm import compute_dtype, grouped_mm
from titan.models.common.init import normal, zeros
from titan.models.common.moe_args import MoEArgs
from titan.models.common.moe_capacity import choice_ranks, padded_slots

AUX_LOSS_NAME = "moe_aux_loss"  # how metrics.jsonl and TensorBoard name it
Z_LOSS_NAME = "moe_z_loss"


class Gate(nn.Linear):
    """The router's projection (with a bias where the family has one); with `float32`,
    computed in float32 whatever the activations' dtype (DeepSeek's sigmoid scores are).
    Parallelisms see a Linear module."""

    def __init__(self, dim: int, n_experts: int, float32: bool, bias: bool = False):
        super().__init__(dim, n_experts, bias=bias)
        self.float32 = float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)
        return super().forward(x)


class Router(nn.Module):
    """Scores (tokens, experts) -> the k chosen experts' weights and indices per token."""

    def __init__(self, dim: int, args: MoEArgs, bias: bool = False):
        super().__init__()
        self.args = args
        self.gate = Gate(dim, args.n_experts, float32=args.score_func == "sigmoid", bias=bias)
        if args.score_bias:
            # model state (checkpointed, exported as HF's e_score_correction_bias), not trained
            # by the optimizer: a load-balancing rule moves it after each step
            self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (tokens, dim) -> weights (tokens, k) float32, indices (tokens, k), and every
        expert's score (tokens, experts) float32, which auxiliary losses use."""
        return self.route(self.gate(x))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gate's logits (tokens, experts) -> what `forward` returns."""
        a = self.args
        if a.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if a.n_groups > 1:
            grouped = choice.unflatten(-1, (a.n_groups, -1))
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_score.topk(a.topk_groups, dim=-1, sorted=False).indices
            dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, kept, False)
            choice = grouped.masked_fill(dropped[..., None], float("-inf")).flatten(-2)
        # sorted as transformers sorts each router's choice: the k weights are summed for
        # the renormalization in this order
        indices = choice.topk(a.top_k, dim=-1, sorted=a.score_func == "softmax").indices
        weights = scores.gather(1, indices)
        if a.norm_topk_prob:
            # DeepSeek's guard against an all-zero sigmoid row; softmax rows are never zero
            eps = 1e-20 if a.score_func == "sigmoid" else 0.0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        if a.route_scale != 1.0:
            weights = weights * a.route_scale
        return weights, indices, scores


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's, Qwen's and DeepSeek's expert activation: silu(gate) x up."""
    return F.silu(gate) * up


class GroupedExperts(nn.Module):
    """n_experts gated FFNs as stacked weights: w1 (gate) and w3 (up) are (experts, hidden,
    dim), w2 (down) is (experts, dim, hidden); with `bias`, b1 and b3 (experts, hidden) and b2
    (experts, dim) too. `activation(gate, up)` makes the hidden activations: SwiGLU, or a
    family's own (a clamped SwiGLU, say), passed in by the family."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
        bias: bool = False,
    ):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))
            self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
        else:
            self.b1 = self.b2 = self.b3 = None

    def param_inits(self, out_init) -> dict:
        inits = {"w1": normal(0.02), "w2": out_init, "w3": out_init}
        if self.b1 is not None:
            inits.update({"b1": zeros, "b2": zeros, "b3": zeros})
        return inits

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim), sorted so that expert e's `counts[e]` rows are contiguous; rows past
        the last expert's (dropped token choices) are no expert's: their outputs are left
        undefined by the grouped GEMM, zero by the loop, and the caller masks them."""
        if _grouped_mm_fits(x, self.w1):
            offsets = counts.cumsum(0).to(torch.int32)  # no host sync
            # each row's expert, for the biases (output_size: no host sync either)
            rows = None
            if self.b1 is not None:
                experts = torch.arange(counts.numel(), device=x.device)
                rows = experts.repeat_interleave(counts, output_size=x.shape[0])

            def linear(t, name, b):
                out = self.product(t, name, offsets=offsets)
                return out if b is None else out + b[rows]

            h = self.activation(linear(x, "w1", self.b1), linear(x, "w3", self.b3))
            return linear(h, "w2", self.b2)
        # the same products one expert at a time, where torch's grouped GEMM cannot run
        sizes = _sizes(counts, x.shape[0])
        rest = x.shape[0] - sum(sizes)
        chunks = x.split([*sizes, rest])
        outs = [self._one(e, chunks[e]) for e in range(len(sizes)) if sizes[e]]
        if rest:
            outs.append(x.new_zeros(rest, self.w2.shape[1]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[1])

    def _one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        # biases added after the product, as the grouped path adds them: the two stay equal
        # bit for bit
        def linear(t, name, b):
            out = self.product(t, name, expert=e)
            return out if b is None else out + b[e]

        h = self.activation(linear(x, "w1", self.b1), linear(x, "w3", self.b3))
        return linear(h, "w2", self.b2)

    def product(
        self, t: torch.Tensor, name: str, offsets: torch.Tensor | None = None, expert: int = -1
    ) -> torch.Tensor:
        """`t` times the stacked weight `name` (w1, w2 or w3), transposed: each expert's rows
        (ending at `offsets`) by its own matrix in one grouped GEMM, or the rows of `expert`
        alone. A subclass may add to a product (low-rank adapters)."""
        w = getattr(self, name)
        if expert >= 0:
            return F.linear(t, w[expert])
        return grouped_mm(t, w.transpose(-2, -1), offsets)


def _sizes(counts: torch.Tensor, rows: int) -> list[int]:
    if torch.compiler.is_compiling() or not is_fake(counts):
        return counts.tolist()  # under torch.compile, a graph break (other devices)
    # fake tensors (the memory planner's trace) hold no values; whatever the split, the
    # experts' tensors add up to the same rows x width, so an even one has the same bytes
    n = counts.numel()
    return [rows // n + (e < rows % n) for e in range(n)]


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Where torch's grouped GEMM runs, in the dtype a linear layer would compute in (under
    autocast, its dtype: `grouped_mm` casts the operands): CUDA in bfloat16, and in float32
    (torch's fallback kernel, 3.6-7.4x faster than the per-expert loop on an H100 in spite of
    its host reads of the offsets: benchmarks/RESULTS.md), with 16-byte aligned rows; CPU in
    float32, where it equals the per-expert loop bit for bit, forward and backward, and is
    faster (tests/unit/test_moe.py), and in bfloat16; compiled too (titan::grouped_mm). The
    planner's fake tensors take it only in bfloat16, all torch's shape function accepts."""
    dtype = compute_dtype(x, w)
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16):
        return False
    aligned = (x.shape[-1] * dtype.itemsize) % 16 == 0 and (w.shape[-2] * dtype.itemsize) % 16 == 0
    if torch.compiler.is_compiling() or not is_fake(x):  # a real run, eager or compiled
        return x.device.type == "cpu" or (x.is_cuda and aligned)
    return dtype == torch.bfloat16 and aligned


class MoE(nn.Module):
    """Router + routed experts (+ shared experts), in place of a block's FeedForward. Each part
    is built from `args` (softmax or sigmoid router without bias, SwiGLU experts, one SwiGLU
    of n_shared_experts x hidden_dim) unless the family passes its own: a `Router` with a bias,
    `GroupedExperts` with biases or another activation, as `shared` any module on every token
    that has an `param_inits` (as FeedForward's)."""

    def __init__(
        self,
        dim: int,
        args: MoEArgs,
        router: Router | None = None,
        experts: GroupedExperts | None = None,
        shared: nn.Module | None = None,
    ):
        super().__init__()
        problems = args.problems()
        if problems:
            raise ValueError("MoE settings: " + "; ".join(problems))
        self.args = args
        self.router = router if router is not None else Router(dim, args)
        self.experts = (
            experts if experts is not None else GroupedExperts(dim, args.hidden_dim, args.n_experts)
        )
        if shared is None and args.n_shared_experts:
            shared = FeedForward(dim, args.hidden_dim * args.n_shared_experts)
        self.shared_experts = shared
        # token choices per expert since the last reset, counted in training steps: what the
        # bias update and the load metrics read (titan.models.common.moe_balance). Not model
        # state: a resumed run starts its step at zero anyway
        self.register_buffer("expert_load", torch.zeros(args.n_experts), persistent=False)
        # token choices dropped for capacity since the last reset (the same counting)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)

    def param_inits(self, out_init) -> dict:
        """Parameter (and bias buffer) name -> how to fill it; `out_init` for what writes the
        residual stream."""
        inits = {"router.gate.weight": normal(0.02), "expert_load": zeros, "dropped": zeros}
        if self.router.gate.bias is not None:
            inits["router.gate.bias"] = zeros
        if self.router.expert_bias is not None:
            inits["router.expert_bias"] = zeros
        inits.update({f"experts.{k}": v for k, v in self.experts.param_inits(out_init).items()})
        if self.shared_experts is not None:
            inits.update(
                {
                    f"shared_experts.{k}": v
                    for k, v in self.shared_experts.param_inits(out_init).items()
                }
            )
        return inits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim), a rank's own tokens (under sequence or context parallelism,
        its part of each sequence)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router.gate(flat)
        weights, indices, scores = self.router.route(logits)
        if collecting():  # a training step (not validation, generation or shape inference)
            self.expert_load.add_(tokens_per_expert(indices, self.args.n_experts))
        out = self.routed(flat, weights, indices, group_tokens=shape[1]).view(shape)
        if self.shared_experts is not None:
            # on the unflattened tokens: tensor parallelism splits them by sequence
            out = out + self.shared_experts(x)
        a = self.args
        if a.aux_loss != "none" and a.aux_loss_coeff and collecting():
            share, groups = balance_loss_share(
                scores, indices, shape[0], a.aux_loss, a.aux_loss_scope, token_split()
            )
            out = attach_group_loss(out, AUX_LOSS_NAME, a.aux_loss_coeff * share, groups)
        if a.router_z_loss_coeff and collecting():
            share, groups = z_loss_share(logits, shape[0], token_split())
            out = attach_group_loss(out, Z_LOSS_NAME, a.router_z_loss_coeff * share, groups)
        return out

    def routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        group_tokens: int | None = None,
    ) -> torch.Tensor:
        """Sum over each token's k experts of weight x expert(token); with a capacity factor,
        over the choices kept in each routing group of `group_tokens` tokens (default: all)."""
        a = self.args
        n_experts, k = a.n_experts, indices.shape[1]
        group = group_tokens or x.shape[0]
        capacity = a.capacity(group)
        kept = None
        flat_experts = indices.reshape(-1)
        if capacity is not None:
            ranks = choice_ranks(weights, indices, group, n_experts, a.drop_policy)
            kept = ranks < capacity
            if collecting():
                self.dropped.add_((~kept).sum())
            if a.pad_to_capacity:
                slots = padded_slots(indices, ranks, kept, group, n_experts, capacity)
                return self._padded(x, weights, slots, n_experts * capacity * (x.shape[0] // group))
            # dropped choices sort after every expert's, where no expert reads them
            flat_experts = torch.where(kept, flat_experts, n_experts)
        # stable: within one expert, tokens keep their order, so each token's k outputs are
        # added in expert order below (what transformers' per-expert loop does)
        order = torch.argsort(flat_experts, stable=True)
        counts = _count(flat_experts, n_experts + (kept is not None))[:n_experts]
        tokens = order // k
        rows = x[tokens]
        if kept is not None:
            keep = kept[order, None]
            rows = torch.where(keep, rows, 0)  # no gradient reaches a dropped choice's token
        out = self.experts(rows, counts)
        if kept is not None:
            # the rows no expert computed, before anything (the weights' gradient) reads them
            out = torch.where(keep, out, 0)
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def _padded(
        self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, n_rows: int
    ) -> torch.Tensor:
        """The capacity-padded computation: each expert gets exactly its capacity of rows per
        group (`n_rows` in all), the kept choices at their `slots` and zero rows elsewhere."""
        k = weights.shape[1]
        tokens = torch.arange(slots.numel(), device=x.device) // k
        # one row past the end takes every dropped choice; no expert reads it
        rows = x.new_zeros(n_rows + 1, x.shape[1]).index_copy(0, slots, x[tokens])
        counts = torch.full((self.args.n_experts,), n_rows // self.args.n_experts, device=x.device)
        out = self.experts(rows[:-1], counts)
        out = torch.cat([out, out.new_zeros(1, out.shape[1])])[slots]
        out = out * weights.reshape(-1, 1)
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))


def z_loss_share(logits: torch.Tensor, batch: int, split: TokenSplit) -> tuple[torch.Tensor, int]:
    """ST-MoE's router z-loss of one layer as this rank's share (like `balance_loss_share`):
    per sequence, the mean over its tokens of logsumexp(logits)^2; this rank's share is the
    sum over its tokens divided by the sequence length, and the step's loss the mean over its
    sequences, so that every layout minimizes the same mean over all tokens."""
    seq_len, sequences = _sequences(split, logits.shape[0], batch)
    z = torch.logsumexp(logits.float(), dim=-1).square().sum()
    return z / seq_len, sequences


# ---------------------------------------------------------------- load balancing


def tokens_per_expert(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of the step's token choices each expert got (float32, for summing over
    microbatches and ranks). A recomputed forward (activation checkpointing) counts a layer
    twice; the bias rule and the imbalance metric depend only on ratios within a layer."""
    return _count(indices.reshape(-1), n_experts).float()


def _count(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    # a scatter, not bincount: its output shape does not depend on the values, so fake
    # tensors (the planner) and compiled graphs take it
    return torch.zeros(n_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts)
    )


@torch.no_grad()
def update_expert_bias_(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias moves by `rate` towards
    the mean load, by the sign of (mean load - its load). `counts` must be summed over every
    microbatch and data-parallel rank, so that every layout moves it alike."""
    bias.add_(rate * torch.sign(counts.mean() - counts).to(bias.dtype))


def balance_loss_share(
    scores: torch.Tensor,
    indices: torch.Tensor,
    batch: int,
    kind: str,
    scope: str,
    split: TokenSplit,
) -> tuple[torch.Tensor, int]:
    """One layer's balancing loss, before its coefficient, as this rank's share: (the sum over
    the token groups this rank holds of its part of each group's loss, the number of groups
    in the step). `scores`, `indices`: this rank's (tokens, experts) and (tokens, k), its
    `batch` sequences' tokens in order; a group is a sequence or the global batch (`scope`).

    Per group of N tokens, with c_e its token choices of expert e and Q_e the sum of its
    tokens' scores for e, the loss is w x sum_e c_e Q_e, with w = n_experts / N^2 for
    "load_balancing" (Switch Transformer's n_experts x sum_e f_e P_e, f_e the share of choices,
    P_e the mean score; k when balanced) and w = n_experts / (k N^2) with each token's scores
    normalized to sum to 1 for "deepseek" (DeepSeek-V3's sequence-wise loss; 1 when balanced).
    The counts carry no gradient: summed over the ranks holding the group's other tokens, they
    make this rank's w x sum_e c_e Q_e(its tokens) its exact share, value and gradient."""
    n_tokens, n_experts = scores.shape
    k = indices.shape[1]
    seq_len, sequences = _sequences(split, n_tokens, batch)
    q = scores if kind == "load_balancing" else scores / scores.sum(dim=-1, keepdim=True)
    chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0)
    counts = chosen.view(batch, -1, n_experts).sum(dim=1)
    q_sums = q.view(batch, -1, n_experts).sum(dim=1)
    if scope == "global_batch":
        counts = split.sum_over_batch(counts.sum(dim=0, keepdim=True))
        q_sums = q_sums.sum(dim=0, keepdim=True)
        n, groups = sequences * seq_len, 1
    else:
        counts = split.sum_over_sequence(counts)
        n, groups = seq_len, sequences
    w = n_experts / (n * n) / (k if kind == "deepseek" else 1)
    return w * (counts.detach() * q_sums).sum(), groups


def _sequences(split: TokenSplit, n_tokens: int, batch: int) -> tuple[int, int]:
    """(tokens of a whole sequence, sequences in the step) of the running step's split; one
    process's: this rank's `batch` sequences of its `n_tokens`."""
    return split.seq_len or n_tokens // batch, split.sequences or batch


def load_balancing_loss(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's (Switch Transformer's) loss of one layer over all these tokens as one
    group: n_experts x sum over experts of (the share of token choices it got) x (its mean
    softmax score); k when perfectly balanced. transformers pools the counts and scores of all
    layers before multiplying; titan's is per layer, the form a pipeline stage can compute."""
    return balance_loss_share(scores, indices, 1, "load_balancing", "global_batch", TokenSplit())[0]


def sequence_balance_loss(
    scores: torch.Tensor, indices: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one layer, averaged over these tokens'
    sequences of `seq_len`: per sequence, sum over experts of f_i x P_i, with
    f_i = n_experts / (k x seq_len) x the sequence's tokens choosing expert i, and P_i the mean
    over the sequence of expert i's score normalized over all experts. 1 when balanced."""
    seqs = scores.shape[0] // seq_len
    share, groups = balance_loss_share(scores, indices, seqs, "deepseek", "sequence", TokenSplit())
    return share / groups
