"""Image-text data's [images] section and checks (`training.dataset_format = "images"`),
registered as every component's are; torch-free (the data are
titan.components.data.image_text)."""

from dataclasses import dataclass

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class Images:
    image_field: str = opt(
        "image",
        "Column naming each record's image file (or list of files, relative to the data "
        "file), or holding the image (a dataset's Image feature)",
    )
    min_pixels: int = opt(
        65536, "An image of a smaller area is resized up to it (the processor's shortest_edge)"
    )
    max_pixels: int = opt(
        16777216, "An image of a larger area is resized down to it (the processor's longest_edge)"
    )


def check(job) -> None:
    """Image-text records: read whole and indexed from one source, packed under a mask that
    keeps each to itself; resize bounds that hold an image."""
    from titan.config.manager import require_all

    t = job.training
    if t.dataset_format != "images":
        return
    mask = "packed image-text records would attend to each other: set it to 'block_causal'"
    require_all(
        job,
        [
            (not t.dataset_mix, "training.dataset_mix", "image data is one source"),
            (not t.dataset_streaming, "training.dataset_streaming", "image data is indexed whole"),
            (job.model.attn_mask_type == "block_causal", "model.attn_mask_type", mask),
            (
                0 < job.images.min_pixels <= job.images.max_pixels,
                "images.min_pixels",
                "must be positive and at most images.max_pixels",
            ),
        ],
    )


def plan_check(job, plan) -> None:
    """A model with a vision tower, and a tokenizer whose vision tokens are the model's."""
    if job.training.dataset_format != "images":
        return
    from titan.config import ConfigError

    args = plan.model_args
    if getattr(args, "vision", None) is None:
        raise ConfigError(
            f"training.dataset_format = 'images': {job.model.name} flavor {job.model.flavor!r} "
            "has no vision tower; train a vision-language flavor (model.name = 'qwen3_vl', or "
            "qwen3_5's '-vision' flavors)"
        )
    if plan.tokenizer is None:
        return
    from titan.components.data.dataset import DataError
    from titan.components.data.image_text import VisionTokens

    try:
        got = VisionTokens.of(plan.tokenizer)
    except DataError as e:
        raise ConfigError(f"training.dataset_format = 'images': {e}") from None
    want = VisionTokens(args.vision_start_id, args.vision_end_id, args.image_token_id)
    if got != want:
        raise ConfigError(
            f"training.dataset_format = 'images': the tokenizer's vision tokens are ids {got} "
            f"but {job.model.name} {job.model.flavor!r} was made with {want}; use the model's "
            "own tokenizer (model.tokenizer_path)"
        )


register(Entry("images", section="images", options=Images, check=check, plan_check=plan_check))
