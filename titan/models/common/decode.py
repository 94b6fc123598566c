"""The cache a model keeps while generating token by token (see `titan.tools.generate`): any
family's attention can use it, as Llama's does."""

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeCache:
    """Keys and values of the tokens decoded so far, for generating token by token.

    Sequences of a batch are left-padded to one length: `pad[b]` leading tokens of sequence
    b are padding, which no token attends to and which do not count as positions."""

    max_len: int
    pad: torch.Tensor  # (batch,) int64
    length: int = 0  # tokens fed so far, padding included
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (batch,) added to each sequence's positions after its prompt: a prompt whose positions
    # were its own (multimodal ones, which grow slower over an image) goes on from its last
    offset: torch.Tensor | None = None

    def positions(self, seq: int) -> torch.Tensor:
        """(batch, seq) positions of the next `seq` tokens of every sequence."""
        idx = torch.arange(self.length, self.length + seq, device=self.pad.device)
        out = (idx[None, :] - self.pad[:, None]).clamp(min=0)
        return out if self.offset is None else out + self.offset[:, None]

    def mask(self, seq: int, first: int = 0) -> torch.Tensor:
        """(batch, 1, seq, length + seq - first): which keys, from cache index `first` on (a
        windowed layer's kept ones), each new token sees."""
        keys = torch.arange(first, self.length + seq, device=self.pad.device)
        queries = torch.arange(self.length, self.length + seq, device=self.pad.device)
        causal = keys[None, :] <= queries[:, None]
        return (causal[None] & (keys[None, None, :] >= self.pad[:, None, None]))[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None):
        """Store the new keys/values (batch, seq, heads, head_dim); return (the keys and
        values the new tokens attend to, the cache index of the first). A layer with a
        `window` keeps only its window - 1 latest keys between calls: no later token can
        see an older one, so its memory stays bounded however long the generation."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"decoding past the cache's {self.max_len} tokens")
        if window is not None:
            kept_k, kept_v = self.kv.get(layer, (k[:, :0], v[:, :0]))
            ks, vs = torch.cat([kept_k, k], dim=1), torch.cat([kept_v, v], dim=1)
            drop = max(ks.shape[1] - (window - 1), 0)
            self.kv[layer] = (ks[:, drop:], vs[:, drop:])
            return ks, vs, end - ks.shape[1]
        if layer not in self.kv:  # keys and values may differ in width (MLA's do)
            self.kv[layer] = tuple(
                t.new_zeros(t.shape[0], self.max_len, *t.shape[2:]) for t in (k, v)
            )
        ck, cv = self.kv[layer]
        ck[:, self.length : end] = k
        cv[:, self.length : end] = v
        return ck[:, :end], cv[:, :end], 0
