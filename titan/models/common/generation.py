"""Decoding a family's model with titan's KV cache (titan.models.common.decode): greedy, or
sampled with temperature, top-k and top-p; what python -m titan.tools.generate and the
lm-eval model's generation run."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> torch.Tensor:
    """(batch, vocab) logits -> (batch,) token ids."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        order = logits.sort(dim=-1, descending=True)
        cum = order.values.softmax(dim=-1).cumsum(dim=-1)
        # drop a token once the more likely ones already hold top_p (always keep the first)
        drop = cum - order.values.softmax(dim=-1) >= s.top_p
        logits = logits.scatter(-1, order.indices, order.values.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    sampling: Sampling = Sampling(),
    on_step=None,
    device: torch.device | None = None,
    fields: dict | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (up to and including EOS). `model(tokens, cache=cache)`
    is a family's model with a decode cache (or a callable as one; then give `device`);
    prompts are left-padded into one batch. `on_step(new_ids)` sees each step's (batch,)
    tokens, e.g. to stream them. `fields`: the prompts' batch fields (their images), left-
    padded as the prompts are, which the model reads with them."""
    from titan.models.common.decode import DecodeCache

    device = device or next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    cache = DecodeCache(max_len=longest + max_new_tokens, pad=pad)
    generator = torch.Generator().manual_seed(sampling.seed)
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    fields = {k: v.to(device) for k, v in (fields or {}).items()}
    logits = model(tokens, cache=cache, **fields)[:, -1]
    for i in range(max_new_tokens):
        nxt = sample(logits, sampling, generator)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                out[b].append(t)
        if on_step is not None:
            on_step(nxt)
        if eos_id is not None:
            done |= nxt == eos_id
        if bool(done.all()) or i == max_new_tokens - 1:
            break  # no forward whose logits nobody samples (under TP, a collective unwaited)
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return out
