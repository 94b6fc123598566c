"""The gated delta rule (Gated DeltaNet's token mixer, as in Qwen3-Next and Qwen3.5): a linear
recurrence over a (key dim x value dim) state per value head,

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t,

with q and k L2-normalized (q also scaled by 1/sqrt(key dim)), g_t <= 0 a log decay and
beta_t in (0, 1) how much of the prediction error is written. Two forms, equal up to float
rounding: `recurrent` walks token by token (decoding, and the reference); `chunked` trains,
solving each chunk's delta-rule writes at once as a unit-lower-triangular system (the WY form
of Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length")
and scanning only over chunks.

Documents: `resets` (batch, seq) marks the tokens that start a document; the state is
emptied before them, so each document computes as if alone (equal to running it by itself).
Both forms take and return the state, so a sequence may continue another's (decoding, a
context-parallel rank continuing the previous rank's chunk).

Shapes: q, k (batch, seq, k_heads, k_dim); v (batch, seq, v_heads, v_dim); g, beta (batch,
seq, v_heads); v_heads a multiple of k_heads (each q/k head serves consecutive value heads);
state (batch, v_heads, k_dim, v_dim). Computed, and the state returned, in float32 (float64
for float64 inputs); the output in q's dtype.
"""

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # the epsilon inside the root, as the released models' kernels place it
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, resets):
    """Heads first, float32, q/k normalized and shared across their value heads; the decay
    of a document's first token -inf (as a multiplier: 0) where `resets` says so."""
    k_heads, v_heads = k.shape[2], v.shape[2]
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads are not a multiple of {k_heads} key heads")
    if v_heads != k_heads:
        q = q.repeat_interleave(v_heads // k_heads, dim=2)
        k = k.repeat_interleave(v_heads // k_heads, dim=2)
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    keep = None if resets is None else (~resets.bool()).unsqueeze(1).expand(-1, g.shape[1], -1)
    return q, k, v, g, beta, keep


def _initial(state, q, v) -> torch.Tensor:
    """The state carried in (zeros without one), for (batch, heads, seq, dim) q and v."""
    if state is None:
        return q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    return state.to(q.dtype)


def recurrent(q, k, v, g, beta, state=None, resets=None):
    """(output (batch, seq, v_heads, v_dim) in q's dtype, the final state)."""
    dtype = q.dtype
    q, k, v, g, beta, keep = _prepare(q, k, v, g, beta, resets)
    s = _initial(state, q, v)
    out = []
    for t in range(q.shape[2]):
        decay = g[:, :, t].exp()
        if keep is not None:
            decay = decay * keep[:, :, t]
        s = s * decay[..., None, None]
        kt = k[:, :, t]
        error = v[:, :, t] - (s * kt.unsqueeze(-1)).sum(-2)
        s = s + kt.unsqueeze(-1) * (beta[:, :, t, None] * error).unsqueeze(-2)
        out.append((s * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(out, 2).transpose(1, 2).to(dtype), s


def chunked(q, k, v, g, beta, state=None, resets=None, chunk: int = 64):
    """As `recurrent`, `chunk` tokens at a time."""
    dtype, seq = q.dtype, q.shape[1]
    q, k, v, g, beta, keep = _prepare(q, k, v, g, beta, resets)
    pad = -seq % chunk
    if pad:  # zero keys, betas and log decays: the padding neither writes nor decays
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        keep = None if keep is None else F.pad(keep, (0, pad), value=True)
    s = _initial(state, q, v)
    b, h, n, _ = q.shape
    c = n // chunk

    def chunks(x):
        return x.reshape(b, h, c, chunk, *x.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    cum = g.cumsum(-1)  # log decay from the chunk's start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if keep is None:
        same = causal
        carried = None  # every token sees the state carried into its chunk
    else:
        # tokens of one document in the chunk: equal counts of document starts up to them
        doc = (~chunks(keep)).cumsum(-1)
        same = causal & (doc.unsqueeze(-1) == doc.unsqueeze(-2))
        carried = (doc == 0).float()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i in one document, else 0 (masked before the
    # exp: a masked difference may be positive and overflow)
    diff = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~same, float("-inf"))
    decay = diff.exp()
    k_beta = k * beta.unsqueeze(-1)
    # the chunk's writes, each correcting the error left by the earlier ones: (I + L) u = beta v
    # with L[i, j] = beta_i k_i.k_j decay[i, j] below the diagonal
    system = (k_beta @ k.transpose(-1, -2)) * decay
    writes = torch.linalg.solve_triangular(
        system, v * beta.unsqueeze(-1), upper=False, unitriangular=True
    )
    # ... and what the carried state contributes to those errors, per unit of state
    reads = k_beta * cum.exp().unsqueeze(-1)
    if carried is not None:
        reads = reads * carried.unsqueeze(-1)
    reads = torch.linalg.solve_triangular(system, reads, upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_carried = q * cum.exp().unsqueeze(-1)
    to_end = (cum[..., -1:] - cum).exp()  # decay from each token to the chunk's end
    end_keep = torch.ones_like(cum[..., -1])
    if carried is not None:
        q_carried = q_carried * carried.unsqueeze(-1)
        to_end = to_end * same[..., -1, :]  # only the last token's document reaches the end
        end_keep = carried[..., -1]
    k_end = k * to_end.unsqueeze(-1)
    state_decay = (cum[..., -1].exp() * end_keep)[..., None, None]
    out = []
    for i in range(c):
        u = writes[:, :, i] - reads[:, :, i] @ s
        out.append(q_carried[:, :, i] @ s + inner[:, :, i] @ u)
        s = s * state_decay[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, 2).reshape(b, h, n, -1)[:, :, :seq]
    return o.transpose(1, 2).to(dtype), s
