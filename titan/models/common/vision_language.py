"""A text decoder with Qwen3-VL's or Qwen3.5's vision tower in front
(titan.models.common.vision): a batch's images become tokens of the text model in the places
of their placeholders, Qwen3-VL's DeepStack features are added to its first blocks' outputs,
and the rotary positions follow the images' grids (titan.models.common.mrope).

The batch carries, beside the tokens (titan.components.data.images makes them):
- `pixel_values` (rows, patches, values) and `image_grid_thw` (rows, images, 3): each row's
  images, padded (a grid of zeros is no image). Row fields: a pipeline splits them by rows
  with the tokens, context parallelism leaves them whole (the tower sees whole images on
  every rank of a CP group, as those ranks see the same batch).
- `vision_slots` (rows, seq): which of its row's image tokens a place holds, -1 for text:
  a per-token field, so that a rank holding part of the sequence places its part.
- `positions` (rows, seq, 3): each token's (time, row, column) position.
"""

import torch
from torch import nn

from titan.models.common.mrope import mrope_rows
from titan.models.common.vision import VisionTower


class ImageTokens(nn.Module):
    """Puts image tokens (or adds DeepStack features) in the places `where` marks, the
    `index`-th of `images`. A module of its own so that sequence parallelism can hand it
    whole sequences (titan.models.common.vision_parallelize)."""

    def forward(self, h, images, where, index, add: bool = False):
        picked = images[index].to(h.dtype)
        return h + torch.where(where, picked, 0) if add else torch.where(where, picked, h)


class VisionLanguage:
    """Mixed in before a Decoder family (`class Qwen3VL(VisionLanguage, Qwen3)`); args with
    titan.models.common.vision_args.VisionLanguageFields. A batch without images (or a
    flavor without a tower) runs the text model alone."""

    batch_fields = ("positions", "pixel_values", "image_grid_thw", "vision_slots")
    row_fields = ("pixel_values", "image_grid_thw")
    input_parts = ("tok_embeddings", "visual", "image_tokens")

    def __init__(self, args):
        super().__init__(args)
        vision = args.vision is not None
        self.visual = VisionTower(args.vision) if vision else None
        self.image_tokens = ImageTokens() if vision else None

    def side_blocks(self) -> list[nn.ModuleDict]:
        return [self.visual.blocks] if self.visual is not None else []

    def forward(self, tokens, cache=None, positions=None, **rest):
        if cache is not None and positions is not None and positions.dim() == 3:
            # a prompt with its multimodal positions: the tokens after it go on from its
            # furthest position, as transformers' rope deltas do
            real = tokens.shape[1] - cache.pad
            cache.offset = positions.amax(dim=(1, 2)) + 1 - (cache.length + real)
        return super().forward(tokens, cache=cache, positions=positions, **rest)

    def embed(self, tokens, pixel_values=None, image_grid_thw=None, vision_slots=None, **rest):
        h, _ = super().embed(tokens, **rest)
        if pixel_values is None or self.visual is None:
            return h, None
        # the images' shapes decide the tower's work: the host reads them (a small copy)
        grids = [[tuple(g) for g in row if g[0] > 0] for row in image_grid_thw.tolist()]
        patches = [sum(t * gh * gw for t, gh, gw in row) for row in grids]
        if not sum(patches):
            return h, None
        pixels = torch.cat([pixel_values[r, :n] for r, n in enumerate(patches)])
        images, deepstack = self.visual(pixels, [g for row in grids for g in row])
        # each row's first image token in `images`
        counts = torch.tensor(patches, device=h.device) // self.visual.args.merge_size**2
        starts = (counts.cumsum(0) - counts)[:, None]
        where = (vision_slots >= 0)[..., None]
        index = (vision_slots + starts).clamp(min=0)
        return self.image_tokens(h, images, where, index), (where, index, deepstack)

    def after_layer(self, layer_id: int, h: torch.Tensor, extra) -> torch.Tensor:
        if extra is None or layer_id >= len(extra[2]):
            return h
        where, index, deepstack = extra
        return self.image_tokens(h, deepstack[layer_id], where, index, add=True)

    def rope_at(self, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None or positions.dim() == 2:
            return super().rope_at(positions)
        return mrope_rows(self.rope, positions, self.args.mrope_section)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        super().init_weights(seed, buffer_device)
        if self.visual is not None:
            self.visual.init_weights(seed)
