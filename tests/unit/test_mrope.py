"""Multimodal rotary positions equal transformers' Qwen3-VL: the three positions of text and
image tokens (images of other grids between text, a two-frame video-like grid), and the
angles of the interleaved sections; text alone is plain RoPE."""

import pytest
import torch

from titan.models.common.mrope import IMAGE, TEXT, mrope_angles, multimodal_positions

GRIDS = [(1, 4, 6), (2, 2, 4)]  # patches; merged 2 x 2: 6 and 4 tokens
KINDS = torch.tensor([TEXT] * 3 + [IMAGE] * 6 + [TEXT] * 2 + [IMAGE] * 4 + [TEXT] * 5)


def test_positions_follow_the_grid():
    pos = multimodal_positions(KINDS, GRIDS, merge=2)
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    # the first image: 2 x 3 merged tokens from position 3
    assert pos[:, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert pos[:, 9].tolist() == [6, 6, 6]  # text goes on from 3 + the longer side (3)
    # the second: two frames of 1 x 2 tokens from position 8
    assert pos[:, 11:15].tolist() == [[8, 8, 9, 9], [8, 8, 8, 8], [8, 9, 8, 9]]
    assert pos[:, 15].tolist() == [10, 10, 10]
    with pytest.raises(ValueError, match="stands on 5 image tokens"):
        multimodal_positions(torch.tensor([TEXT, *[IMAGE] * 5]), [(1, 4, 6)], merge=2)


def test_text_alone_is_plain_rope():
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    pos = multimodal_positions(torch.zeros(7, dtype=torch.long), [], merge=2)
    plain = torch.arange(7)[:, None].float() * inv_freq
    assert torch.equal(mrope_angles(pos, inv_freq, (8, 12, 12)), plain)


@pytest.mark.needs("transformers")
def test_positions_and_angles_equal_transformers():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLModel,
        Qwen3VLTextRotaryEmbedding,
    )

    text = dict(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=64,
        vocab_size=100,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 5, 5]},
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    config = Qwen3VLConfig(text_config=text, vision_config=vision)
    model = Qwen3VLModel(config)
    ids = torch.where(KINDS == IMAGE, config.image_token_id, 5)[None]
    want, _ = model.get_rope_index(ids, KINDS[None].int(), image_grid_thw=torch.tensor(GRIDS))
    got = multimodal_positions(KINDS, GRIDS, merge=2)
    assert torch.equal(got, want[:, 0])
    rope = Qwen3VLTextRotaryEmbedding(config.text_config)
    cos, _ = rope(torch.zeros(1, dtype=torch.float32), want)
    angles = mrope_angles(got, rope.inv_freq, (6, 5, 5))
    torch.testing.assert_close(torch.cat([angles, angles], -1).cos(), cos[0], rtol=0, atol=1e-6)
