"""Images reach the vision tower as Qwen3-VL's processor makes them: the same resized size,
pixel values and grid as transformers' (its PIL processor), for images that shrink, grow or
only round; patches in merge-block order."""

import pytest
import torch

from titan.components.data.images import ImageRule, fitted_size, image_patches

RULE = ImageRule(min_pixels=64 * 64, max_pixels=160 * 160)


def picture(width: int, height: int, seed: int = 0):
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_sizes_follow_the_rule():
    assert fitted_size(64, 96, RULE) == (64, 96)  # multiples of 32 within the bounds: kept
    assert fitted_size(70, 100, RULE) == (64, 96)  # rounded
    h, w = fitted_size(300, 500, RULE)  # shrunk under max_pixels, aspect about kept
    assert h * w <= RULE.max_pixels and (h, w) == (96, 192)
    h, w = fitted_size(20, 30, RULE)  # grown over min_pixels
    assert h * w >= RULE.min_pixels and (h, w) == (64, 96)
    with pytest.raises(ValueError, match="sides differ more than 200-fold"):
        fitted_size(1, 300, RULE)


@pytest.mark.needs("PIL")
def test_an_image_already_fitted_is_its_normalized_pixels_in_merge_blocks():
    image = picture(96, 64)  # 4 x 6 patches of 16: the resize is the identity
    pixels, grid = image_patches(image, RULE)
    assert grid.tolist() == [1, 4, 6] and pixels.shape == (24, 3 * 2 * 16 * 16)
    x = (torch.tensor(list(image.getdata()), dtype=torch.float32).view(64, 96, 3) / 255 - 0.5) / 0.5
    # the second patch of the first merged token: rows 0-15, columns 16-31, both frames alike
    patch = pixels[1].view(3, 2, 16, 16)
    torch.testing.assert_close(patch[:, 0], x[:16, 16:32].permute(2, 0, 1))
    assert torch.equal(patch[:, 0], patch[:, 1])
    # the third patch: the first token's second row
    torch.testing.assert_close(pixels[2].view(3, 2, 16, 16)[:, 0], x[16:32, :16].permute(2, 0, 1))


@pytest.mark.needs("transformers", "PIL")
@pytest.mark.parametrize("size", [(100, 70), (500, 300), (30, 20), (64, 64), (2000, 10)])
def test_pixels_and_grid_equal_transformers_processor(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=RULE.min_pixels,
        max_pixels=RULE.max_pixels,
        image_mean=list(RULE.mean),
        image_std=list(RULE.std),
    )
    image = picture(*size)
    want = hf(images=[image], return_tensors="pt")
    pixels, grid = image_patches(image, RULE)
    assert grid.tolist() == want["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pixels, want["pixel_values"].float(), rtol=0, atol=1e-6)


@pytest.mark.needs("transformers", "PIL")
def test_an_exports_processor_file_is_transformers_processor_of_the_rule(tmp_path):
    """preprocessor_config.json as an HF export writes it: transformers' processor read from
    it cuts an image as titan does, and titan reads the same rule back."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from titan.components.data.image_text import image_rule, write_processor
    from titan.models.common.vision_args import VISION_DEBUG

    rule = ImageRule(patch_size=8, min_pixels=4096, max_pixels=16384)
    write_processor(tmp_path, rule)
    assert image_rule(VISION_DEBUG, None, tmp_path) == rule
    hf = Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    image = picture(150, 40)
    want = hf(images=[image], return_tensors="pt")
    pixels, grid = image_patches(image, rule)
    assert grid.tolist() == want["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pixels, want["pixel_values"].float(), rtol=0, atol=1e-6)
