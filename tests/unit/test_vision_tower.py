"""The vision tower of Qwen3-VL (with DeepStack) and Qwen3.5 gives transformers' outputs for
the same weights and images: several images of other grids, and a video of two frames, in one
batch; its position table resampled to each grid, its attention within each frame."""

import pytest
import torch

from titan.models.common.vision import VisionTower, grid_positions
from titan.models.common.vision_args import VISION_DEBUG

GRIDS = [(1, 4, 6), (2, 2, 4), (1, 6, 2)]  # (frames / 2, rows, columns) of patches


def hf_tower(family: str, args):
    """transformers' tower of `family` at `args`' shape, random weights, in fp32 eval."""
    common = dict(
        depth=args.depth,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_heads=args.n_heads,
        patch_size=args.patch_size,
        temporal_patch_size=args.temporal_patch_size,
        spatial_merge_size=args.merge_size,
        out_hidden_size=args.out_dim,
        num_position_embeddings=args.num_position_embeddings,
    )
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        config = Qwen3VLVisionConfig(**common, deepstack_visual_indexes=list(args.deepstack_layers))
        model = Qwen3VLVisionModel._from_config(config, attn_implementation="sdpa")
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        config = Qwen3_5VisionConfig(**common)
        model = Qwen3_5VisionModel._from_config(config, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.float().eval()


def titan_tower(args, hf) -> VisionTower:
    tower = VisionTower(args).eval()
    state = dict(hf.state_dict())
    weight = state["patch_embed.proj.weight"]
    state["patch_embed.proj.weight"] = weight.reshape(weight.shape[0], -1)  # the Conv3d's matmul
    tower.load_state_dict(state, strict=True)
    return tower


@pytest.mark.needs("transformers")
@pytest.mark.parametrize(
    "family, deepstack", [("qwen3_vl", (0, 1)), ("qwen3_5", ())], ids=["qwen3_vl", "qwen3_5"]
)
def test_the_tower_gives_transformers_tokens(family, deepstack):
    args = VISION_DEBUG.with_updates(deepstack_layers=deepstack)
    hf = hf_tower(family, args)
    tower = titan_tower(args, hf)
    grid = torch.tensor(GRIDS)
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, args.patch_values, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid)
        got, got_deepstack = tower(pixels, grid)
    assert got.shape == (patches // 4, args.out_dim)
    torch.testing.assert_close(got, want.pooler_output, rtol=1e-5, atol=1e-5)
    want_deepstack = getattr(want, "deepstack_features", None) or []
    assert len(got_deepstack) == len(deepstack) == len(want_deepstack)
    for a, b in zip(got_deepstack, want_deepstack, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_patches_come_in_merge_blocks():
    # a 2 x 4 grid merged 2 x 2: the first token's patches are rows 0-1 of columns 0-1
    rc = grid_positions([(1, 2, 4)], merge=2).tolist()
    assert rc == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


def test_init_is_seeded_by_name():
    a, b = VisionTower(VISION_DEBUG), VisionTower(VISION_DEBUG)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(a.merger.norm.weight, torch.ones_like(a.merger.norm.weight))
    assert a.blocks["0"].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.2)
    for args in (VISION_DEBUG, VISION_DEBUG.with_updates(deepstack_layers=(1,))):
        assert args.num_params() == sum(p.numel() for p in VisionTower(args).parameters())


def test_the_towers_training_flops_are_what_torch_counts():
    """VisionArgs.training_flops: 3 x the forward's matmul and attention FLOPs as torch's
    FlopCounterMode counts them (the convention of the text model's figure)."""
    from torch.utils.flop_counter import FlopCounterMode

    args = VISION_DEBUG.with_updates(deepstack_layers=(0, 1))
    tower = VisionTower(args).eval()
    patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(patches, args.patch_values)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tower(pixels, GRIDS)
    assert args.training_flops(GRIDS) == pytest.approx(3 * counter.get_total_flops(), rel=1e-9)
