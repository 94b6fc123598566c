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


def mrope_axes(sections: tuple[int, int, int], pairs: int, device=None) -> torch.Tensor:
    """(pairs,): the position (0 time, 1 row, 2 column) each rotated pair turns with: the row
    where i % 3 == 1 and i < 3 x sections[1], the column where i % 3 == 2 and i < 3 x
    sections[2], time otherwise."""
    i = torch.arange(pairs, device=device)
    axis = torch.zeros_like(i)
    for a in (1, 2):
        axis = torch.where((i % 3 == a) & (i < 3 * sections[a]), a, axis)
    return axis


def mrope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, int, int]
) -> torch.Tensor:
    """Angles (..., pairs) of `positions` (3, ...) for the rotated pairs of `inv_freq`
    (pairs,), each pair's from the position `mrope_axes` gives it."""
    angles = positions[..., None].float() * inv_freq.float()  # (3, ..., pairs)
    axis = mrope_axes(sections, inv_freq.shape[0], inv_freq.device)
    return angles.gather(0, axis.expand_as(angles[:1])).squeeze(0)


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, sections) -> torch.Tensor:
    """The rotation (batch, seq, pairs, 2) of tokens at `positions` (batch, seq, 3) from a
    plain RoPE `table` (max_seq_len, pairs, 2): each pair's row is its axis's position."""
    pairs = table.shape[1]
    axis = mrope_axes(sections, pairs, positions.device)
    rows = positions.gather(-1, axis.expand(*positions.shape[:-1], pairs))
    return table[rows, torch.arange(pairs, device=positions.device)]
