"""A decoder-only transformer assembled from common pieces: embedding, pre-norm blocks
(attention, then a feed-forward network, each with a residual), final norm, and an output
projection that may be tied to the embedding.

A family subclasses `Decoder` with its `build_block` and `rope_table`; everything the trainer
needs of a model (the Model protocol of titan/models/spec.py) is here. Pure model code:
parallelisms rewrite a built model from outside; submodules a pipeline stage drops are set to
None and skipped in forward.
"""

import math

import torch
from torch import nn

from titan.models.common.decode import DecodeCache
from titan.models.common.documents import (
    block_causal_block_mask,
    block_causal_mask,
    block_causal_mask_between,
)
from titan.models.common.init import normal, ones, seeded_init_, seeded_init_all
from titan.parallelisms import sequence_shard


class TransformerBlock(nn.Module):
    def __init__(
        self,
        layer_id: int,
        dim: int,
        norm_eps: float,
        attention: nn.Module,
        feed_forward: nn.Module,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = feed_forward

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache: DecodeCache | None = None, mask=None
    ) -> torch.Tensor:
        h = x + self.attention(
            self.attention_norm(x), rope, cache=cache, layer=self.layer_id, mask=mask
        )
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self) -> dict:
        """Parameter name (within the block) -> how to fill it."""
        # depth-scaled std on the projections that write into the residual stream
        deep = normal(0.02 / math.sqrt(2 * (self.layer_id + 1)))
        inits = {"attention_norm.weight": ones, "ffn_norm.weight": ones}
        for name in ("attention", "feed_forward"):
            part = getattr(self, name).param_inits(deep)
            inits.update({f"{name}.{k}": v for k, v in part.items()})
        return inits

    def init_weights(self, seed: int, prefix: str) -> None:
        seeded_init_all(self, self.param_inits(), seed, prefix)


class Decoder(nn.Module):
    """`args` needs dim, n_layers, vocab_size, norm_eps, max_seq_len, tie_word_embeddings."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        # each layer's sliding window (None: full attention), for its document mask
        self.sliding_windows = [self.layer_window(i, args) for i in range(args.n_layers)]
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): self.build_block(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # recomputed, never checkpointed: it is a pure function of the args
        self.register_buffer("rope", self._rope_buffer(args), persistent=False)

    def _rope_buffer(self, args) -> torch.Tensor:
        if torch.get_default_device().type != "meta":
            return self.rope_table(args)
        # a meta model's table has a shape only (init_weights computes it): computed on meta,
        # torch's meta arange would import torch._dynamo, a second of every rank's start-up
        with torch.device("cpu"):
            row = self.rope_table(args.with_updates(max_seq_len=1))
        return torch.empty((args.max_seq_len, *row.shape[1:]), dtype=row.dtype)

    def build_block(self, layer_id: int, args) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must define build_block")

    def layer_window(self, layer_id: int, args) -> int | None:
        """The sliding window of a layer's attention (None: full); a family whose layers
        alternate (GPT-OSS's, Gemma's) overrides it and builds those layers' Attention with
        the same `sliding_window`."""
        return None

    @staticmethod
    def rope_table(args, device=None) -> torch.Tensor:
        """The (max_seq_len, head_dim/2, 2) RoPE table of titan.models.common.rope."""
        raise NotImplementedError("a Decoder family must define rope_table")

    # multiplies the final hidden state the output layer reads, so the logits, in training and
    # decoding alike (also where the output layer is a chunked loss); a converter sets it
    # (muP's 1/width output multiplier)
    output_scale = 1.0

    # what only the first pipeline stage holds: what `embed` reads
    input_parts: tuple[str, ...] = ("tok_embeddings",)

    # whether forward takes the step's `labels` (the trainer passes them then): a family that
    # trains on targets inside forward (DeepSeek-V3's multi-token prediction) sets it
    takes_labels = False
    # batch fields forward takes by name (see titan.models.spec.ModelProtocol)
    batch_fields: tuple[str, ...] = ()
    # those of them that are per row, not per token (a row's images): CP leaves them whole
    row_fields: tuple[str, ...] = ()

    def forward(
        self,
        tokens: torch.Tensor,
        cache: DecodeCache | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **fields: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of every position; with `cache`, `tokens` continue the cached ones.

        `doc_ids` (batch, seq): attend only within each document (block-causal);
        `positions` (batch, seq): each token's RoPE position, when not 0, 1, 2, ...;
        `labels` (batch, seq): the targets, when `takes_labels`; `fields`: the other batch
        fields the family lists in `batch_fields`, for its `embed`."""
        h, extra = self.embed(tokens, **fields)
        rope = self.rope_at(positions)
        masks = {}
        if cache is not None:
            for i, layer in self.trunk():
                h = self.after_layer(i, layer(h, rope, cache=cache), extra)
        else:
            masks = self._masks(doc_ids)
            for i, layer in self.trunk():
                mask = masks.get(self.sliding_windows[i])
                h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
                h = self.after_layer(i, h, extra)
        h = self.norm(h) if self.norm is not None else h
        if self.output is not None and self.output_scale != 1.0:
            h = h * self.output_scale
        if cache is not None:
            cache.length += tokens.shape[1]
            return self.output(h) if self.output is not None else h
        if self.output is None:
            return h
        return self.head(h, rope, masks.get(None), labels)

    def embed(self, tokens: torch.Tensor, **fields: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The input hidden states (a later pipeline stage's `tokens` are already hidden
        states) and what the family's `after_layer` needs of the inputs (None here); a family
        that embeds more than tokens (images) takes its batch fields here."""
        if fields:
            raise TypeError(f"{type(self).__name__} takes no batch fields {sorted(fields)}")
        return (self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens), None

    def side_blocks(self) -> list[nn.ModuleDict]:
        """Stacks of blocks beside the decoder's (a vision tower's), which activation
        checkpointing, compile and FSDP wrap block by block as they do the decoder's."""
        return []

    def after_layer(self, layer_id: int, h: torch.Tensor, extra: object) -> torch.Tensor:
        """The hidden states after block `layer_id` as the next block reads them (as they
        are here; Qwen3-VL adds image features to its first blocks' outputs)."""
        return h

    def rope_at(self, positions: torch.Tensor | None) -> torch.Tensor:
        """The rotation of each position: the table's rows in order, or those `positions`
        (batch, seq) pick."""
        return self.rope if positions is None else self.rope[positions]

    def trunk(self) -> list[tuple[int, nn.Module]]:
        """(index, block) of the main stack's blocks this part holds, in order: layers 0 ..
        n_layers - 1. Blocks past them (DeepSeek-V3's multi-token prediction) are the
        family's `head`'s to run."""
        return [(int(i), b) for i, b in self.layers.items() if int(i) < self.args.n_layers]

    def head(self, h: torch.Tensor, rope: torch.Tensor, mask, labels) -> torch.Tensor:
        """The logits of the final hidden states `h` (normalized); a family may add training
        objectives on them here (`mask`: the full-attention document mask, or None). An
        output layer that takes the labels (a chunked loss) returns the loss sum instead."""
        if labels is not None and getattr(self.output, "takes_labels", False):
            return self.output(h, labels)
        return self.output(h)

    def _masks(self, doc_ids: torch.Tensor | None) -> dict:
        """Each layer's document mask by its window: one bool mask for all (a windowed layer
        applies its window itself), or on CUDA one FlexAttention BlockMask per window."""
        if doc_ids is None:
            return {}
        windows = self.attention_windows()
        shard = sequence_shard.active()
        if shard is not None and shard.by_heads:
            # all-to-all CP: attention sees its group's tokens in order (the whole sequence
            # unless hybrid, whose groups gather each other's keys: outer())
            doc_ids, shard = shard.whole(doc_ids, dim=1), shard.outer()
        if shard is not None:  # context parallelism: this rank's queries, every rank's keys
            keys = shard.gather(doc_ids, dim=1)
            mask = block_causal_mask_between(doc_ids, keys, shard.positions, shard.all_positions())
            return dict.fromkeys(windows, mask)
        if doc_ids.is_cuda:
            return {w: block_causal_block_mask(doc_ids, w) for w in windows}
        mask = block_causal_mask(doc_ids)
        return dict.fromkeys(windows, mask)

    def attention_windows(self) -> set:
        """The windows of the layers whose attention takes a document mask (a family whose
        other layers mix tokens otherwise leaves theirs out and adds their own input)."""
        return set(self.sliding_windows)

    def tied_parameters(self) -> list[tuple[str, str]]:
        # the name a checkpoint or HF file stores first, then the name that shares it
        return [("tok_embeddings.weight", "output.weight")] if self.args.tie_word_embeddings else []

    def cp_buffers(self) -> list[tuple[torch.Tensor, int]]:
        # RoPE rows are positions: under CP each rank keeps the rows of its sequence chunk
        return [(self.rope, 0)]

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter from (seed, its name), whatever the sharding."""
        self.rope = self.rope_table(self.args, device=buffer_device or self.rope.device)
        out_init = normal(self.args.dim**-0.5)
        tied = self.args.tie_word_embeddings
        # a tied matrix starts at HF's initializer_range (0.02): at init the normed residual
        # stream is mostly the input token's own embedding, whose logit is then std x dim
        # against the others' spread of std x sqrt(dim) (at std dim^-0.5 the first logits
        # pick the input token itself: a first loss of 13.5 for the debug model, not ~7.6)
        tied_init = normal(0.02)
        if tied and self.tok_embeddings is not None and self.output is not None:
            # to_empty() gives each module its own new parameter: tie them again
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            seeded_init_(
                self.tok_embeddings.weight,
                "tok_embeddings.weight",
                seed,
                tied_init if tied else normal(1.0, truncate=False),
            )
        for layer_id, layer in self.layers.items():
            layer.init_weights(seed, f"layers.{layer_id}")
        if self.norm is not None:
            seeded_init_(self.norm.weight, "norm.weight", seed, ones)
        if self.output is not None and not (tied and self.tok_embeddings is not None):
            # a pipeline's last stage holds a copy of a tied matrix: the same values
            seeded_init_(
                self.output.weight,
                "tok_embeddings.weight" if tied else "output.weight",
                seed,
                tied_init if tied else out_init,
            )
