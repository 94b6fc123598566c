"""The vision tower of Qwen3-VL and Qwen3.5 (titan.models.common.vision_args): image patches in,
one token for the text model per merge_size x merge_size patches out.

A batch's images (and video frames) arrive as the processor makes them: `pixel_values`, every
patch of every image flattened to channels x frames x pixels, in merge-block order (the
patches one text token merges stand together), and `grid_thw`, each image's grid of
(frames / temporal_patch_size, rows, columns) of patches. The tower embeds each patch
(transformers' Conv3d, whose stride is its kernel, as the one matmul it is), adds the learned
position table resampled (bilinear) to the image's grid, and runs pre-norm blocks whose
attention stays within each frame of each image, with 2D rotary positions (half of each head
turns with the patch's row, half with its column). The merger then joins each block of
merge_size^2 patches into one token of the text model's width; Qwen3-VL's DeepStack mergers
do the same to the output of some blocks, whose tokens its first decoder layers add to
their hidden states. Parameter names are transformers' (under `model.visual.`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.init import normal, ones, seeded_init_, zeros
from titan.models.common.rope import apply_rope, inverse_frequencies
from titan.models.common.vision_args import VisionArgs
from titan.parallelisms.sequence_shard import plain_sdpa
from titan.runtime.names import canonical_name


def grid_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(patches, 2): each patch's (row, column) in its image, in merge-block order."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        rc = torch.stack([rows, cols], dim=-1)
        rc = rc.reshape(h // merge, merge, w // merge, merge, 2).transpose(1, 2).reshape(-1, 2)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, spans: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(1, n, 3, self.n_heads, -1).unbind(2)  # (1, patches, heads, hd)
        # transformers' rotate_half layout: pair i is (i, i + head_dim / 2)
        q, k = (apply_rope(t, rope, interleaved=False) for t in (q, k))
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (heads, patches, hd)
        # each frame of each image attends within itself
        # the kernel itself: a context-parallel region turns F's SDPA into ring attention
        # over the ranks' parts of the text, and every rank holds these images whole
        out = [
            plain_sdpa(qs, ks, vs)
            for qs, ks, vs in zip(*(t.split(spans, dim=1) for t in (q, k, v)), strict=True)
        ]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.dim, args.ffn_dim)
        self.linear_fc2 = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, spans: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge_size^2 neighbouring patches -> one token of `out_dim`; the norm runs on each patch
    (the main merger) or on the merged block (`after_merge`: DeepStack's)."""

    def __init__(self, args: VisionArgs, after_merge: bool = False):
        super().__init__()
        self.merged = args.dim * args.merge_size**2
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.merged if after_merge else args.dim, eps=args.norm_eps)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.after_merge else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.merged))))


class PositionTable(nn.Embedding):
    """The learned position table, a square of side x side, resampled (bilinear, corners
    aligned) to each image's grid, in merge-block order."""

    def forward(self, grids, merge: int) -> torch.Tensor:
        side, dim = int(round(self.num_embeddings**0.5)), self.embedding_dim
        table = self.weight.view(side, side, dim).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            grid = grid.permute(1, 2, 0).reshape(h // merge, merge, w // merge, merge, dim)
            out.append(grid.transpose(1, 2).reshape(h * w, dim).repeat(t, 1))
        return torch.cat(out)


class VisionTower(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(args.patch_values, args.dim)
        self.pos_embed = PositionTable(args.num_position_embeddings, args.dim)
        # by index as the hub names them; a dict so that AC and compile wrap them in place
        self.blocks = nn.ModuleDict({str(i): VisionBlock(args) for i in range(args.depth)})
        self.merger = PatchMerger(args)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(args, after_merge=True) for _ in args.deepstack_layers
        )
        self.register_buffer("inv_freq", _inv_freq(args), persistent=False)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the text model's tokens of every image, in order: patches / merge_size^2 of
        `out_dim`; the DeepStack features, one such tensor per deepstack layer). The grids
        are shapes, read on the host (given as a list, they are not read again)."""
        a = self.args
        grids = [tuple(g) for g in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
        x = self.patch_embed.proj(pixel_values.view(-1, a.patch_values).to(self.pos_embed.weight))
        x = x + self.pos_embed(grids, a.merge_size).to(x.dtype)
        rope = self._rope(grids, x.device)
        spans = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks.values()):
            x = block(x, rope, spans)
            if i in a.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[a.deepstack_layers.index(i)](x))
        return self.merger(x), deepstack

    def _rope(self, grids, device) -> torch.Tensor:
        """The rotation of every patch, (1, patches, head_dim / 2, (cos, sin)) as
        titan.models.common.rope.apply_rope takes it: rows turn the first half of the pairs,
        columns the second, at the same frequencies."""
        rc = grid_positions(grids, self.args.merge_size).to(device)
        angles = (rc[..., None].float() * self.inv_freq.float()).flatten(1)  # (patches, hd/2)
        return torch.stack([angles.cos(), angles.sin()], dim=-1)[None]

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "visual") -> None:
        """Every weight from (seed, its name), as the text model's are (0.02, biases 0)."""
        for name, p in self.named_parameters():
            # seeded by the name alone: activation checkpointing's wrapper left out
            name = canonical_name(name)
            if isinstance(self.get_submodule(name.rpartition(".")[0]), nn.LayerNorm):
                fill = ones if name.endswith("weight") else zeros
            else:
                fill = normal(0.02) if name.endswith("weight") else zeros
            seeded_init_(p, f"{prefix}.{name}", seed, fill)
        self.inv_freq = _inv_freq(self.args, self.inv_freq.device)


def _inv_freq(args: VisionArgs, device=None) -> torch.Tensor:
    """A quarter of a head's dims of rotary frequencies: rows and columns use the same."""
    return inverse_frequencies(args.head_dim // 2, args.rope_theta).float().to(device)
