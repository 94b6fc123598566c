"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5: projections to
queries, keys, values, an output gate z and per-head write strengths (beta) and decay rates;
a short causal depthwise convolution (SiLU) over the queries, keys and values; the gated delta
rule (titan.models.common.gated_delta_rule); an RMSNorm of each head's output gated by
SiLU(z); the output projection.

Parameters are laid out as the hub's: the input projections by key-head group (a key head and
the value heads it serves), so that a tensor-parallel split of the heads splits them into
contiguous rows; the convolution's channels as all queries, all keys, all values (a tensor-
parallel rank convolves the rows of its own heads: titan.models.common.hybrid_parallelize).

Documents (`resets`: a document's first token): the convolution sees no token of an earlier
document and the recurrent state is emptied, so each document computes as if alone. A
`LinearState` (the convolution's last inputs and the recurrent state) continues a sequence:
decoding, or a context-parallel rank continuing the previous rank's part.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan.models.common import gated_delta_rule
from titan.models.common.init import normal, ones
from titan.parallelisms import sequence_shard


@dataclass
class LinearState:
    conv: torch.Tensor  # (batch, kernel - 1, channels): the latest convolution inputs
    recurrent: torch.Tensor  # (batch, value heads, key dim, value dim), float32


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (float32), then x SiLU(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        # the weight multiplies in the input's dtype, the gate in float32: as the released
        # checkpoints were trained
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None, keep):
    """Depthwise causal convolution of (batch, seq, channels) `x` with (channels, kernel)
    `weight` (its last column on the token itself), after `past` (batch, kernel - 1, channels)
    inputs; `keep` (batch, seq) bool, False at a document's first token: no tap reaches back
    past it. Returns (output, the latest kernel - 1 inputs)."""
    kernel = weight.shape[1]
    b, seq, c = x.shape
    if past is None:
        past = x.new_zeros(b, kernel - 1, c)
    full = torch.cat([past.to(x.dtype), x], 1)
    out = full[:, kernel - 1 :] * weight[:, -1]
    # reach[t, j]: tap j tokens back from token t stays in its document
    reach = None if keep is None else torch.ones_like(keep)
    for j in range(1, kernel):
        tap = full[:, kernel - 1 - j : kernel - 1 - j + seq] * weight[:, -1 - j]
        if reach is not None:
            # a token j back is in the document when no document starts within the last j
            reach = reach & _shifted(keep, j - 1)
            tap = tap * reach.unsqueeze(-1)
        out = out + tap
    return out, full[:, seq:]


def _shifted(keep: torch.Tensor, j: int) -> torch.Tensor:
    """keep[t - j] at t (True before the sequence: a carried state is the same document)."""
    if j == 0:
        return keep
    return F.pad(keep, (j, 0), value=True)[:, : keep.shape[1]]


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        dim: int,
        k_heads: int,
        v_heads: int,
        k_dim: int,
        v_dim: int,
        conv_kernel: int,
        norm_eps: float,
        chunk: int = 64,
    ):
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"{v_heads} value heads do not group into {k_heads} key heads")
        self.k_heads, self.k_dim, self.v_dim, self.chunk = k_heads, k_dim, v_dim, chunk
        self.group = v_heads // k_heads  # value heads per key head
        # per key head: q (k_dim), k (k_dim), its value heads' v, then their z
        self.in_qkvz = nn.Linear(dim, k_heads * (2 * k_dim + 2 * self.group * v_dim), bias=False)
        # per key head: its value heads' beta logits, then their decay inputs
        self.in_ba = nn.Linear(dim, 2 * v_heads, bias=False)
        # channels: all queries, all keys, all values
        self.conv = nn.Parameter(
            torch.empty(k_heads * (2 * k_dim + self.group * v_dim), conv_kernel)
        )
        self.dt_bias = nn.Parameter(torch.empty(v_heads))
        self.A_log = nn.Parameter(torch.empty(v_heads))
        self.norm = GatedRMSNorm(v_dim, norm_eps)
        self.out = nn.Linear(v_heads * v_dim, dim, bias=False)

    def param_inits(self, out_init) -> dict:
        """The hub models' initialization: decay rates A uniform in [0.01, 16) (A_log its
        log), dt_bias 1."""

        def a_log(t, g):
            t.uniform_(0.01, 16, generator=g).log_()

        return {
            "in_qkvz.weight": normal(0.02),
            "in_ba.weight": normal(0.02),
            "conv": _conv_init,
            "dt_bias": ones,
            "A_log": a_log,
            "norm.weight": ones,
            "out.weight": out_init,
        }

    def forward(
        self,
        x: torch.Tensor,
        resets: torch.Tensor | None = None,
        state: LinearState | None = None,
    ) -> tuple[torch.Tensor, LinearState | None]:
        """(output, the state after the last token) of (batch, seq, dim) `x`. Under context
        parallelism (x this rank's part of each sequence, `resets` the whole sequences'), the
        recurrence needs every earlier token: the heads are exchanged for the tokens, each
        rank running 1/cp of the heads over the whole sequence (no state is returned)."""
        b, seq, _ = x.shape
        kd, vd, r = self.k_dim, self.v_dim, self.group
        # -1: key-head groups (under tensor parallelism, this rank's)
        q, k, v, z = (
            self.in_qkvz(x)
            .view(b, seq, -1, 2 * kd + 2 * r * vd)
            .split([kd, kd, r * vd, r * vd], -1)
        )
        beta, a = self.in_ba(x).view(b, seq, -1, 2 * r).split([r, r], -1)
        v, z = v.reshape(b, seq, -1, vd), z.reshape(b, seq, -1, vd)
        beta, a = beta.reshape(b, seq, -1), a.reshape(b, seq, -1)
        shard = sequence_shard.active()
        if shard is None:
            o, state = self._mix(
                q, k, v, z, beta, a, self.conv, self.dt_bias, self.A_log, resets, state
            )
        else:
            o, state = self._mix_by_heads(shard, q, k, v, z, beta, a, resets), None
        return self.out(o.flatten(2)), state

    def group_channels(self, k_heads: int, block: int, blocks: int) -> torch.Tensor:
        """The channels of key-head groups `block` of `blocks` (equal runs of groups) in a
        convolution over `k_heads` groups (all queries, all keys, all values): those groups'
        queries', keys' and values' rows, in that order (a tensor- or context-parallel
        rank's own)."""
        kd, vd = self.k_dim, self.group * self.v_dim
        n = k_heads // blocks
        q = torch.arange(block * n * kd, (block + 1) * n * kd)
        v = torch.arange(block * n * vd, (block + 1) * n * vd) + 2 * k_heads * kd
        return torch.cat([q, q + k_heads * kd, v])

    def _mix(self, q, k, v, z, beta, a, conv, dt_bias, A_log, resets, state):
        """Convolution, gated delta rule and gated norm of (batch, seq, heads, dim) inputs
        and these heads' parameters: ((batch, seq, value heads, v_dim), the state after)."""
        b, seq, n_k, kd = q.shape
        keep = None if resets is None else ~resets.bool()
        widths = [n_k * kd, n_k * kd, v.shape[2] * self.v_dim]
        mixed, conv_state = causal_conv(
            torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1),
            conv,
            None if state is None else state.conv,
            keep,
        )
        q, k, v = F.silu(mixed).split(widths, -1)
        q, k = q.view(b, seq, -1, kd), k.view(b, seq, -1, kd)
        v = v.view(b, seq, -1, self.v_dim)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        rule = gated_delta_rule.recurrent if seq == 1 else gated_delta_rule.chunked
        kwargs = {} if seq == 1 else {"chunk": self.chunk}
        o, recurrent = rule(
            q, k, v, g, beta.sigmoid(), None if state is None else state.recurrent, resets, **kwargs
        )
        return self.norm(o, z), LinearState(conv_state, recurrent)

    def _mix_by_heads(self, shard, q, k, v, z, beta, a, resets) -> torch.Tensor:
        """`_mix` of this rank's 1/cp of the heads over every token, the result sent back to
        the ranks holding the tokens (the all-to-all exchanges of titan.parallelisms'
        SequenceShard)."""
        if shard.across is not None:  # refused before launch (hybrid_args' plan check)
            raise ValueError("Gated DeltaNet needs each sequence whole in an all-to-all group")
        cp, rank = shard.group.size(), dist.get_rank(group=shard.group)

        def whole(t):  # (batch, tokens, heads, d) -> (batch, every token, heads / cp, d)
            return shard.heads_in(t.transpose(1, 2)).transpose(1, 2)

        n_k, n_v = q.shape[2], v.shape[2]
        kd, vd = self.k_dim, self.v_dim
        qk = whole(torch.cat([q, k], -1))
        per_v = whole(torch.cat([v, z, beta.unsqueeze(-1), a.unsqueeze(-1)], -1))
        q, k = qk.split([kd, kd], -1)
        v, z, beta, a = per_v.split([vd, vd, 1, 1], -1)
        # this rank's rows of the convolution (its heads' queries, keys and values) and of
        # the per-head parameters
        rows = self.group_channels(n_k, rank, cp).to(self.conv.device)
        conv = self.conv.index_select(0, rows)
        mine_v = n_v // cp
        dt_bias = self.dt_bias.narrow(0, rank * mine_v, mine_v)
        A_log = self.A_log.narrow(0, rank * mine_v, mine_v)
        o, _ = self._mix(
            q, k, v, z, beta.squeeze(-1), a.squeeze(-1), conv, dt_bias, A_log, resets, None
        )
        return shard.heads_out(o.transpose(1, 2)).transpose(1, 2)


def _conv_init(t: torch.Tensor, g: torch.Generator) -> None:
    # nn.Conv1d's default for a depthwise kernel: uniform within 1/sqrt(fan-in)
    bound = t.shape[1] ** -0.5
    t.uniform_(-bound, bound, generator=g)
