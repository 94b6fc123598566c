"""Multimodal rotary positions (Qwen3-VL, Qwen3.5): each token has three positions, (time,
row, column), and the rotated pairs of a head are shared out among them.

Text tokens count on as in plain RoPE, the three positions equal. An image's tokens (one per
merge_size x merge_size patches, in row-major order of the merged grid) all start from the
position the image begins at: time adds the frame, row and column add the token's row and
column in the merged grid. The text after the image goes on from the start plus the longer
side of the merged grid, so that positions grow about as fast over an image as over its
length in text. Where every position of a token is equal (text only) the angles are plain
RoPE's.

The rotated pairs' frequencies are laid out interleaved: pair i takes its angle from time,
row or column as i mod 3 says (0, 1, 2), up to 3 x the row's and column's section; the pairs
after that are time's.
"""

import torch

TEXT = 0  # a token's kind in `kinds`; an image's tokens are IMAGE
IMAGE = 1


def multimodal_positions(
    kinds: torch.Tensor, grids: list[tuple[int, int, int]], merge: int
) -> torch.Tensor:
    """(3, seq) positions of one sequence whose tokens are of `kinds` (TEXT / IMAGE, (seq,)):
    each run of IMAGE tokens is the next image of `grids` ((frames, rows, columns) of
    patches), whose merged grid it must cover."""
    out, pos, images = [], 0, iter(grids)
    runs = torch.diff(kinds, prepend=kinds[:1] - 1).nonzero().flatten().tolist() + [len(kinds)]
    for start, end in zip(runs, runs[1:], strict=False):
        if int(kinds[start]) == TEXT:
            out.append(torch.arange(pos, pos + end - start).expand(3, -1))
            pos += end - start
            continue
        t, h, w = next(images)
        h, w = h // merge, w // merge
        if t * h * w != end - start:
            raise ValueError(
                f"an image of {t}x{h}x{w} merged tokens stands on {end - start} image tokens: "
                "the text's placeholders must match the image's grid"
            )
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out.append(torch.stack([g.flatten() for g in grid]) + pos)
        pos += max(h, w)
    return torch.cat(out, dim=1)


def mrope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, int, int]
) -> torch.Tensor:
    """Angles (..., pairs) of `positions` (3, ...) for the rotated pairs of `inv_freq`
    (pairs,): pair i turns with the row where i % 3 == 1 and i < 3 x sections[1], with the
    column where i % 3 == 2 and i < 3 x sections[2], with time otherwise."""
    angles = positions[..., None].float() * inv_freq.float()  # (3, ..., pairs)
    pairs = torch.arange(inv_freq.shape[0], device=inv_freq.device)
    axis = torch.zeros_like(pairs)
    for a in (1, 2):
        axis = torch.where((pairs % 3 == a) & (pairs < 3 * sections[a]), a, axis)
    return angles.gather(0, axis.expand_as(angles[:1])).squeeze(0)
