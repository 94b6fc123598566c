"""Image-text samples packed into windows for a vision-language model
(titan.models.common.vision_language): each record becomes BOS, each image's tokens between
<|vision_start|> and <|vision_end|> (one <|image_pad|> per merge_size^2 patches of the image
as the processor's rule resizes it), its text and EOS; the loss counts the text after the
images (a caption), nothing that predicts an image's tokens.

Records are packed whole into windows of `seq_len` places in the data's order, as chat data
is: a record that does not fit the open window starts the next one, so an image is never cut
by a window edge; a record longer than a window is left out (logged, with the first such).
The window's images are decoded, resized and cut into patches when a loader worker fetches
it (titan.components.data.images), with its batch fields:
pixel_values (patches, values) and image_grid_thw (images, 3), row fields the collate pads;
vision_slots and positions (multimodal, each record's from 0), per token; doc_ids (each
record its own document, the padding another).
"""

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import Dataset

from titan.components.data.batch import Batch, sample
from titan.components.data.dataset import DataError, with_progress
from titan.components.data.images import ImageRule, fitted_size, image_patches
from titan.components.training.loss import IGNORE_INDEX
from titan.models.common.mrope import IMAGE, TEXT, multimodal_positions

logger = logging.getLogger(__name__)

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


@dataclass(frozen=True)
class VisionTokens:
    start: int
    end: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> "VisionTokens":
        """The tokenizer's vision tokens; a DataError naming those it lacks."""
        ids = {t: tokenizer.token_id(t) for t in (VISION_START, VISION_END, IMAGE_PAD)}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise DataError(
                f"the tokenizer has no {', '.join(missing)}: image data needs a tokenizer with "
                "the vision tokens (the model's own, or assets/tokenizer_vlm)"
            )
        return cls(*ids.values())


def grid_of(size: tuple[int, int], rule: ImageRule) -> tuple[int, int, int]:
    """(frames, rows, columns) of patches of an image of `size` (height, width)."""
    h, w = fitted_size(*size, rule)
    return 1, h // rule.patch_size, w // rule.patch_size


def with_images(ids: list[int], grids, vt: VisionTokens, merge: int, where: str = "a sample"):
    """(ids, kinds) of tokens holding one <|image_pad|> per image (as a chat template writes
    them), each widened to its image's tokens; a DataError when the placeholders are not one
    per image."""
    holes = [i for i, t in enumerate(ids) if t == vt.pad]
    if len(holes) != len(grids):
        raise DataError(
            f"{where} has {len(holes)} image placeholder(s) for {len(grids)} image(s); give "
            "each image one placeholder ({'type': 'image'} in a message's content)"
        )
    out, kinds, last = [], [], 0
    for at, (t, h, w) in zip(holes, grids, strict=True):
        n = t * h * w // merge**2
        out += ids[last:at] + [vt.pad] * n
        kinds += [TEXT] * (at - last) + [IMAGE] * n
        last = at + 1
    out += ids[last:]
    kinds += [TEXT] * (len(ids) - last)
    return out, kinds


def prompt_tokens(grids, text_ids: list[int], vt: VisionTokens, merge: int, bos: int):
    """(ids, kinds) of BOS, each image between its vision tokens, then `text_ids`."""
    ids = [bos, *[t for _ in grids for t in (vt.start, vt.pad, vt.end)], *text_ids]
    return with_images(ids, grids, vt, merge)


def record_tokens(grids, text_ids: list[int], vt: VisionTokens, merge: int, bos: int, eos: int):
    """(ids, labels, kinds) of one record: int arrays of its places."""
    ids, kinds = prompt_tokens(grids, [*text_ids, eos], vt, merge, bos)
    first_text = len(ids) - len(text_ids) - 1
    ids = np.asarray(ids, np.int64)
    labels = np.full(len(ids), IGNORE_INDEX, np.int64)
    # the place before each text token predicts it; the last place predicts nothing
    labels[first_text - 1 : -1] = ids[first_text:]
    return ids, labels, np.asarray(kinds, np.int8)


def image_fields(kinds, grids, pixels: list[torch.Tensor], merge: int) -> dict:
    """The batch fields of one sequence of `kinds` (TEXT / IMAGE) whose images have these
    `grids` and patches: positions, vision_slots, pixel_values, image_grid_thw."""
    kinds = torch.as_tensor(kinds, dtype=torch.long)
    images = kinds == IMAGE
    return {
        "positions": multimodal_positions(kinds, list(grids), merge).T,
        "vision_slots": torch.where(images, images.cumsum(0) - 1, -1),
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.tensor([list(g) for g in grids]),
    }


@dataclass
class Packed:
    """Where a record sits in its window: its first place, its length, its images' grids."""

    record: int
    start: int
    length: int
    grids: tuple


def conversation_tokens(record, grids, template, vt: VisionTokens, merge: int):
    """(ids, labels, kinds) of an image conversation rendered with the chat template: the
    loss on the assistant's tokens only (prompt and images masked), as chat data's."""
    try:
        ids, counted = template.encode(record.messages)
    except DataError as e:
        raise DataError(f"{record.where}: {e}; fix the template or drop that record") from None
    ids, kinds = with_images(ids, grids, vt, merge, record.where)
    counted = np.asarray(_widened(counted, kinds), bool)
    ids, kinds = np.asarray(ids, np.int64), np.asarray(kinds, np.int8)
    labels = np.full(len(ids), IGNORE_INDEX, np.int64)
    labels[:-1] = np.where(counted[1:], ids[1:], IGNORE_INDEX)
    return ids, labels, kinds


def _widened(counted: list[bool], kinds: list[int]) -> list[bool]:
    """`counted` (of the tokens before each image placeholder was widened) for the widened
    tokens: an image's places are never counted."""
    out, it, previous = [], iter(counted), None
    for k in kinds:
        if k == IMAGE and previous == IMAGE:
            out.append(False)
        else:
            out.append(bool(next(it)) and k == TEXT)
        previous = k
    return out


class ImageTextWindows(Dataset):
    def __init__(
        self, source, records, rule: ImageRule, tokenizer, seq_len: int, name: str, template=None
    ):
        self.source, self.records, self.rule = source, records, rule
        self.seq_len, self.name, self.pad_id = seq_len, name, tokenizer.pad_id
        vt, merge = VisionTokens.of(tokenizer), rule.merge_size
        self.placed: list[list[Packed]] = []
        self.tokens: list[tuple] = []
        fill, dropped = seq_len, []
        texts = tokenizer.encode_batch([r.text for r in records], bos=False, eos=False)
        for i, (record, text_ids) in enumerate(zip(records, texts, strict=True)):
            grids = tuple(grid_of(s, rule) for s in record.sizes)
            if record.messages is not None:
                ids, labels, kinds = conversation_tokens(record, grids, template, vt, merge)
            else:
                ids, labels, kinds = record_tokens(
                    grids, list(text_ids), vt, merge, tokenizer.bos_id, tokenizer.eos_id
                )
            if len(ids) > seq_len:
                dropped.append(record.where)
                self.tokens.append(None)
                continue
            if fill + len(ids) > seq_len:
                self.placed.append([])
                fill = 0
            self.placed[-1].append(Packed(i, fill, len(ids), grids))
            self.tokens.append((ids, labels, kinds))
            fill += len(ids)
        if dropped:
            logger.warning(
                "%s: %d record(s) longer than training.seq_len %d left out (the first: %s); "
                "raise training.seq_len or lower images.max_pixels to keep them",
                name,
                len(dropped),
                seq_len,
                dropped[0],
            )
        if not self.placed:
            raise DataError(
                f"{name}: no record fits training.seq_len {seq_len} (the first: {dropped[0]} "
                "needs more places for its image and text); raise training.seq_len or lower "
                "images.max_pixels"
            )

    def __len__(self) -> int:
        return len(self.placed)

    def __getitem__(self, w: int) -> Batch:
        L = self.seq_len
        inputs = torch.full((L,), self.pad_id, dtype=torch.long)
        labels = torch.full((L,), IGNORE_INDEX, dtype=torch.long)
        docs = torch.full((L,), len(self.placed[w]), dtype=torch.int32)
        positions = torch.zeros((L, 3), dtype=torch.long)
        slots = torch.full((L,), -1, dtype=torch.long)
        pixels, grids, seen = [], [], 0
        for doc, p in enumerate(self.placed[w]):
            ids, lab, kinds = self.tokens[p.record]
            span = slice(p.start, p.start + p.length)
            inputs[span], labels[span], docs[span] = (
                torch.from_numpy(ids),
                torch.from_numpy(lab),
                doc,
            )
            record = self.records[p.record]
            own = [
                self._patches(record, ref, grid)
                for ref, grid in zip(record.images, p.grids, strict=True)
            ]
            f = image_fields(kinds, p.grids, own, self.rule.merge_size)
            positions[span] = f["positions"]
            # the window's image tokens counted on from the records before
            slots[span] = torch.where(f["vision_slots"] >= 0, f["vision_slots"] + seen, -1)
            seen += int((f["vision_slots"] >= 0).sum())
            pixels.append(f["pixel_values"])
            grids.append(f["image_grid_thw"])
        return sample(
            inputs,
            labels,
            doc_ids=docs,
            positions=positions,
            vision_slots=slots,
            pixel_values=torch.cat(pixels),
            image_grid_thw=torch.cat(grids),
        )

    def _patches(self, record, ref, grid) -> torch.Tensor:
        """An image's patches, decoded, resized and cut by the rule."""
        values, got = image_patches(self.source.read(ref, record.where), self.rule)
        if tuple(got.tolist()) != grid:  # the header said another size than the pixels
            raise DataError(f"{record.where}: the image's size changed since indexing")
        return values


def image_text_windows(
    source, rule: ImageRule, tokenizer, seq_len: int, name: str, template: str = ""
) -> ImageTextWindows:
    """The windows of an image source; conversations among its records are rendered with
    the chat template (`template`: a file, or the tokenizer folder's)."""
    VisionTokens.of(tokenizer)  # the tokenizer's vision tokens, named before any image is read
    counted = []
    records = list(
        with_progress(
            (counted.append(1) or r for r in source.records()),
            lambda s: f"indexing image data: {len(counted)} records so far ({s:.0f}s)",
        )
    )
    if not records:
        raise DataError(f"{name} holds no image-text records")
    chat = None
    if any(r.messages is not None for r in records):
        from titan.components.data.chat_template import ChatTemplate

        chat = ChatTemplate.load(tokenizer, template)
    windows = ImageTextWindows(source, records, rule, tokenizer, seq_len, name, chat)
    images = sum(len(p.grids) for w in windows.placed for p in w)
    logger.info(
        "image data %s: %d records, %d images in %d windows of %d places",
        name,
        sum(len(w) for w in windows.placed),
        images,
        len(windows),
        seq_len,
    )
    return windows


def planning_fields(vision, rows: int, seq_len: int) -> dict:
    """The image fields of the heaviest batch the planner counts (titan.planner.activations):
    every row one square image filling its window but for its 3 text places (the tower's
    activations grow with the patches). All but the pixels are small real tensors (the tower
    reads the grids on the host)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    m = vision.merge_size
    side = int((seq_len - 3) ** 0.5)  # merged tokens a side
    tokens = side * side
    with unset_fake_temporarily():  # small: made real
        grids = torch.tensor([[[1, side * m, side * m]]] * rows)
        kinds = torch.full((seq_len,), TEXT, dtype=torch.long)
        kinds[2 : 2 + tokens] = IMAGE
        positions = multimodal_positions(kinds, [(1, side * m, side * m)], m).T
        slots = torch.full((seq_len,), -1, dtype=torch.long)
        slots[2 : 2 + tokens] = torch.arange(tokens)
    return {
        "pixel_values": torch.zeros(rows, tokens * m * m, vision.patch_values),
        "image_grid_thw": grids,
        "positions": positions.expand(rows, -1, -1),
        "vision_slots": slots.expand(rows, -1),
    }


def prompt_batch(prompts: list[tuple[list[int], dict]]) -> dict:
    """The batch fields of prompts (ids, image_fields) left-padded to the longest, as
    titan.models.common.generation pads their tokens: positions 0 and no image slot on the
    padding; each row's images as the collate pads them."""
    from titan.components.data.batch import collate

    longest = max(len(ids) for ids, _ in prompts)
    rows = []
    for ids, f in prompts:
        pad = longest - len(ids)
        rows.append(
            {
                **f,
                "positions": torch.cat([f["positions"].new_zeros(pad, 3), f["positions"]]),
                "vision_slots": torch.cat(
                    [f["vision_slots"].new_full((pad,), -1), f["vision_slots"]]
                ),
            }
        )
    return collate(rows)


def image_rule(vision, images=None, folder=None) -> ImageRule:
    """The processor's rule for a tower (`vision`: VisionArgs): its patches, and the area
    bounds and normalization of an HF folder's preprocessor_config.json where `folder` holds
    one, else of the [images] section (`images`), else the released processors' defaults."""
    import json
    from pathlib import Path

    rule = ImageRule(
        patch_size=vision.patch_size,
        merge_size=vision.merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )
    config = Path(folder) / "preprocessor_config.json" if folder is not None else None
    if config is not None and config.is_file():
        c = json.loads(config.read_text())
        size = c.get("size") or {}
        return replace(
            rule,
            min_pixels=int(size.get("shortest_edge", c.get("min_pixels", rule.min_pixels))),
            max_pixels=int(size.get("longest_edge", c.get("max_pixels", rule.max_pixels))),
            mean=tuple(c.get("image_mean", rule.mean)),
            std=tuple(c.get("image_std", rule.std)),
        )
    if images is not None:
        return replace(rule, min_pixels=images.min_pixels, max_pixels=images.max_pixels)
    return rule


def write_processor(folder, rule: ImageRule) -> None:
    """preprocessor_config.json of an HF export: transformers' Qwen2-VL image processor with
    the rule the model trained with (what `image_rule` reads back)."""
    import json
    from pathlib import Path

    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(rule.mean),
        "image_std": list(rule.std),
        "size": {"shortest_edge": rule.min_pixels, "longest_edge": rule.max_pixels},
        "patch_size": rule.patch_size,
        "temporal_patch_size": rule.temporal_patch_size,
        "merge_size": rule.merge_size,
    }
    (Path(folder) / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
