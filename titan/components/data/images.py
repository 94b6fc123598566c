"""Images as Qwen3-VL's and Qwen3.5's processor hands them to the vision tower
(titan.models.common.vision), on PIL and torch: each image resized so that its sides are
multiples of patch_size x merge_size and its area within [min_pixels, max_pixels] (aspect
kept as closely as that allows; bicubic), scaled to [0, 1], normalized, and cut into
patches in merge-block order, each flattened to channels x frames x pixels (an image is one
frame shown temporal_patch_size times). The rules and defaults are those of the released
checkpoints' preprocessor configs (transformers' Qwen2VLImageProcessor, which they name);
tests/unit/test_images.py compares the two where transformers is installed.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageRule:
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536  # the preprocessor config's size.shortest_edge (an area)
    max_pixels: int = 16777216  # size.longest_edge (an area)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def fitted_size(height: int, width: int, rule: ImageRule) -> tuple[int, int]:
    """The (height, width) an image is resized to: sides rounded to multiples of the factor,
    then scaled down (or up) as a whole, sides floored (ceiled) to multiples, until the area
    is within the rule's bounds."""
    f = rule.factor
    if max(height, width) > 200 * min(height, width):
        raise ValueError(
            f"an image of {width}x{height} pixels: its sides differ more than 200-fold, which "
            "the vision tower's processor does not take; crop or pad it"
        )
    h, w = round(height / f) * f, round(width / f) * f  # 0 for a side under f / 2: grown below
    if h * w > rule.max_pixels:
        shrink = math.sqrt(height * width / rule.max_pixels)
        h = max(f, math.floor(height / shrink / f) * f)
        w = max(f, math.floor(width / shrink / f) * f)
    elif h * w < rule.min_pixels:
        grow = math.sqrt(rule.min_pixels / (height * width))
        h, w = math.ceil(height * grow / f) * f, math.ceil(width * grow / f) * f
    return h, w


def pil():
    """PIL's Image module, or one ImportError naming the extra that installs it."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("images in the batch need pillow: pip install 'titan[vision]'") from e
    return Image


def image_patches(image, rule: ImageRule = ImageRule()) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel values (patches, 3 x frames x patch x patch) float32, its grid (frames, rows,
    columns) of patches) of one PIL image."""
    Image = pil()
    image = image.convert("RGB")
    h, w = fitted_size(image.height, image.width, rule)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.BICUBIC)
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3)
    x = x.permute(2, 0, 1).float() * (1 / 255)
    mean, std = torch.tensor(rule.mean)[:, None, None], torch.tensor(rule.std)[:, None, None]
    x = (x - mean) / std
    p, m, t = rule.patch_size, rule.merge_size, rule.temporal_patch_size
    rows, cols = h // p, w // p
    x = x.view(3, rows // m, m, p, cols // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    # (row blocks, column blocks, m, m, channel, p, p): one frame, shown t times
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)
    return x.reshape(rows * cols, 3 * t * p * p).contiguous(), torch.tensor([1, rows, cols])
