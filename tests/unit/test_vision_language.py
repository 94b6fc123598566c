"""Qwen3-VL and Qwen3.5 with their vision towers (dense and MoE debug flavors) give
transformers' logits on the same weights and the same bundled pictures, cut by titan's image
data (titan.components.data.image_text) as the model sees them in training; their HF folders
go both ways bitwise (the tower's Conv3d patch embedding included) and transformers reads them;
the released sizes hold the parameters their args count."""

import pytest
import torch

from tests.forked import built_model
from titan.components.checkpoint import hf_io
from titan.models.spec import get_train_spec

# family, flavor, transformers' config and model classes
CASES = {
    "qwen3_vl": ("qwen3_vl", "debugmodel", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": (
        "qwen3_vl",
        "debugmodel_moe",
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
    ),
    "qwen3_5": (
        "qwen3_5",
        "debugmodel_vision",
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
    ),
    "qwen3_5_moe": (
        "qwen3_5",
        "debugmodel_moe_vision",
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
    ),
}
PICTURES = ["train/0000.png", "train/0003.png", "valid/0001.png"]  # 64x64, 96x64 or 64x96


def case(name, max_seq_len=160):
    family, flavor, *_ = CASES[name]
    spec = get_train_spec(family)
    return spec, spec.flavors[flavor].with_updates(max_seq_len=max_seq_len)


def hf_model(name, spec, args):
    import transformers

    *_, config_cls, model_cls = CASES[name]
    cfg = spec.state_dict_adapter(args).hf_config()
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    config = getattr(transformers, config_cls)(**cfg)
    return getattr(transformers, model_cls)._from_config(config, attn_implementation="sdpa")


def one_record(args, pictures=PICTURES, text="a red circle and a blue square."):
    """The model's inputs for one record of `pictures` and `text` (a batch of one), made as
    the image data make them, and transformers' mm_token_type_ids."""
    from PIL import Image

    from titan.components.data.image_text import VisionTokens, record_tokens
    from titan.components.data.images import ImageRule, image_patches
    from titan.components.data.tokenizer import Tokenizer
    from titan.models.common.mrope import IMAGE, multimodal_positions

    tokenizer = Tokenizer("assets/tokenizer_vlm")
    v = args.vision
    rule = ImageRule(
        patch_size=v.patch_size, merge_size=v.merge_size, min_pixels=1, max_pixels=1 << 20
    )
    images = [Image.open(f"assets/images/shapes/{p}") for p in pictures]
    pixels, grids = zip(*(image_patches(im, rule) for im in images), strict=True)
    vt = VisionTokens.of(tokenizer)
    ids, _, kinds = record_tokens(
        [tuple(g.tolist()) for g in grids],
        tokenizer.encode(text, bos=False, eos=False),
        vt,
        v.merge_size,
        tokenizer.bos_id,
        tokenizer.eos_id,
    )
    kinds = torch.from_numpy(kinds.astype("int64"))
    is_image = kinds == IMAGE
    fields = {
        "positions": multimodal_positions(kinds, [tuple(g.tolist()) for g in grids], 2).T[None],
        "pixel_values": torch.cat(pixels)[None],
        "image_grid_thw": torch.stack(grids)[None],
        "vision_slots": torch.where(is_image, is_image.cumsum(0) - 1, -1)[None],
    }
    return torch.from_numpy(ids)[None], fields, kinds[None]


def hf_logits(hf, ids, fields, kinds):
    """transformers' logits of one record (its batch of one) made by `one_record`."""
    pixels, grids = fields["pixel_values"][0], fields["image_grid_thw"][0]
    out = hf(
        input_ids=ids, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=kinds.int()
    )
    return out.logits


@pytest.mark.needs("transformers", "PIL")
@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_on_real_pictures(name):
    spec, args = case(name)
    model = built_model(spec, args, seed=3)
    hf = hf_model(name, spec, args).float().eval()
    missing, unexpected = hf.load_state_dict(
        spec.state_dict_adapter(args).to_hf(model.state_dict()), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding's
    ids, fields, kinds = one_record(args)
    with torch.no_grad():
        ours = model(ids, **fields)
        torch.testing.assert_close(ours, hf_logits(hf, ids, fields, kinds), rtol=0, atol=1e-4)
        # the image changes the logits: the tower is in the path
        assert (ours - model(ids)).abs().max() > 1e-2
        # text alone: the text model with plain positions, as transformers'
        text = ids[:, :1]
        torch.testing.assert_close(model(text), hf(input_ids=text).logits, rtol=0, atol=1e-4)


@pytest.mark.needs("transformers", "PIL")
@pytest.mark.parametrize("name", ["qwen3_vl_moe", "qwen3_5"])
def test_hf_folder_round_trip_is_bitwise_and_transformers_reads_it(tmp_path, name):
    spec, args = case(name)
    model = built_model(spec, args, seed=5)
    state = model.state_dict()
    hf_io.save_hf(state, spec, args, tmp_path / "hf")
    names = hf_io.load_hf_state(tmp_path / "hf")
    weight = names["model.visual.patch_embed.proj.weight"]
    v = args.vision
    assert weight.shape == (v.dim, 3, v.temporal_patch_size, v.patch_size, v.patch_size)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert hf_io.args_from_hf(tmp_path / "hf", spec, args.max_seq_len) == args
    back = hf_io.load_hf(tmp_path / "hf", spec)
    assert set(back) == set(state)
    for k, t in state.items():
        assert torch.equal(back[k], t), k
    # transformers loads the folder as its own and answers alike
    import transformers

    hf = getattr(transformers, CASES[name][3]).from_pretrained(tmp_path / "hf").float().eval()
    ids, fields, kinds = one_record(args, PICTURES[:1])
    with torch.no_grad():
        theirs = hf_logits(hf, ids, fields, kinds)
        torch.testing.assert_close(model.eval()(ids, **fields), theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "family, flavor",
    [("qwen3_vl", f) for f in ("2B", "4B", "8B", "32B", "30B-A3B")] + [("qwen3_5", "27B-vision")],
)
def test_released_sizes_hold_the_counted_parameters(family, flavor):
    """Built on the meta device, a released size holds what its args count; its tower is the
    released one (under 0.7B beside the text model)."""
    spec = get_train_spec(family)
    args = spec.flavors[flavor]
    assert not args.problems()
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    tower = sum(p.numel() for p in model.visual.parameters())
    assert tower == args.vision.num_params() and 0.3e9 < tower < 0.7e9


def test_debug_towers_hold_the_counted_parameters():
    for name in CASES:
        spec, args = case(name)
        model = built_model(spec, args)
        assert sum(p.numel() for p in model.parameters()) == args.num_params()
        assert args.num_params(active=True) < args.num_params() - args.vision.num_params() + 1


def test_mismatched_tower_and_sections_are_named():
    spec, args = case("qwen3_vl")
    bad = args.with_updates(mrope_section=(8, 8, 8), vision=args.vision.with_updates(out_dim=64))
    problems = " ".join(bad.problems())
    assert "mrope_section (8, 8, 8) must add up to the 16 rotated pairs" in problems
    assert "vision out_dim 64 must be the text model's dim 256" in problems


def test_a_pipeline_keeps_deepstacks_layers_with_the_tower():
    """DeepStack's features (debugmodel: into layers 0 and 1) cannot cross a stage edge."""
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    argv = ["--job.config_file", "train_configs/debug_vlm.toml"]
    pp = ["--parallelism.pipeline_parallel_degree"]
    assert plan_run(parse_args([*argv, *pp, "2"]), world_size=2).pipelines[0].layer_ranges[
        0
    ] == range(0, 2)
    with pytest.raises(ConfigError, match=r"DeepStack features enter layers 0..1"):
        plan_run(parse_args([*argv, *pp, "4"]), world_size=4)


@pytest.mark.needs("PIL")
def test_lora_adapts_the_towers_layers():
    """lora.target_modules may name the tower's linear layers: their adapters learn from the
    image (B starts at 0, so A's gradient is 0 at first: B's is not), the rest frozen."""
    from types import SimpleNamespace

    from titan.components.lora.adapters import apply_lora

    spec, args = case("qwen3_vl")
    model = built_model(spec, args, seed=3, eval=False)
    cfg = SimpleNamespace(
        rank=4, alpha=8.0, dropout=0.0, target_modules=[r"visual\.blocks\.\d+\.attn\.qkv$"]
    )
    adapted = apply_lora(model, cfg)
    assert adapted == [f"visual.blocks.{i}.attn.qkv" for i in range(args.vision.depth)]
    for name in adapted:
        qkv = model.get_submodule(name)
        torch.nn.init.normal_(qkv.lora_a, std=0.02)
        torch.nn.init.zeros_(qkv.lora_b)
    ids, fields, _ = one_record(args)
    model(ids, **fields).float().pow(2).mean().backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.{f}" for n in adapted for f in ("lora_a", "lora_b")}
    assert all(model.get_submodule(n).lora_b.grad.abs().sum() > 0 for n in adapted)


def vl_folder(folder, spec, args):
    """An HF folder of `args`' model with weights that say more than one token (an init
    repeats one), the bundled VLM tokenizer and the processor rule debug_vlm.toml trains at,
    as an export writes them."""
    import shutil

    from titan.components.data.image_text import write_processor
    from titan.components.data.images import ImageRule

    model = built_model(spec, args, seed=7)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.3)
    hf_io.save_hf(model.state_dict(), spec, args, folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"assets/tokenizer_vlm/{f}", folder / f)
    v = args.vision
    write_processor(folder, ImageRule(patch_size=v.patch_size, min_pixels=4096, max_pixels=16384))


@pytest.mark.needs("transformers", "PIL")
@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_generation_about_a_picture_equals_transformers(tmp_path, capsys, name):
    """python -m titan.tools.generate --checkpoint HF_DIR --image PATH --prompt TEXT: the KV
    cache's decode steps go on from the prompt's furthest multimodal position, as
    transformers' rope deltas do: the same greedy tokens as its generate."""
    import transformers

    from titan.components.data.tokenizer import Tokenizer
    from titan.tools.generate import main as generate_main

    spec, args = case(name, max_seq_len=128)
    vl_folder(tmp_path / "hf", spec, args)
    picture = f"assets/images/shapes/{PICTURES[1]}"
    new = 12
    generate_main(
        ["--checkpoint", str(tmp_path / "hf"), "--image", picture, "--prompt", "a"]
        + ["--max-new-tokens", str(new)]
    )
    ours = capsys.readouterr().out
    hf = getattr(transformers, CASES[name][3]).from_pretrained(tmp_path / "hf").float().eval()
    ids, fields, kinds = one_record(args, [PICTURES[1]], text="a")
    ids, kinds = ids[:, :-1], kinds[:, :-1]  # the prompt: no EOS
    tokenizer = Tokenizer("assets/tokenizer_vlm")
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            pixel_values=fields["pixel_values"][0],
            image_grid_thw=fields["image_grid_thw"][0],
            mm_token_type_ids=kinds.int(),
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=tokenizer.eos_id,
        )[0, ids.shape[1] :].tolist()
    theirs = tokenizer.decode(out, skip_special=True)
    assert len(out) == new  # random weights: no EOS within these tokens
    assert len(set(out)) > 2
    assert ours.strip() == ("a" + theirs).strip()


def _image_generation(rank, world, port, folder, chat, texts=("a", "what is it?")):
    """The tool's path on one rank of `world` (tensor parallel above 1): the greedy tokens."""
    from types import SimpleNamespace

    from tests.forked import torchrun_env
    from titan.models.common.generation import generate
    from titan.tools import generate as tool

    job, path, spec, tokenizer = tool.open_checkpoint(str(folder), [])
    opts = SimpleNamespace(image=[f"assets/images/shapes/{PICTURES[1]}"], chat=chat, system=None)
    opts.prompt = list(texts)
    prompts, fields = tool.image_prompts(
        opts, job, path, tokenizer, tool.model_args(path, job, spec)
    )
    dims = None
    if world > 1:
        import torch.distributed as dist

        from titan.parallelisms.parallel_dims import ParallelDims

        torchrun_env(rank, world, port)
        dist.init_process_group("gloo")
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, world_size=world)
        dims.build_mesh("cpu")
        job = tool._tp_job(job, world)
    model, _ = tool.load_model(path, job, spec, 128, torch.device("cpu"), dims)
    return generate(model, prompts, max_new_tokens=8, eos_id=None, fields=fields)


@pytest.mark.needs("PIL")
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_generation_about_a_picture_is_alike_on_tp2(tmp_path, chat):
    """Two prompts of other lengths about one picture (left-padded: their positions and image
    slots with them), plain and as chat turns: the same greedy tokens on TP 2 as on 1 rank."""
    from tests.forked import free_port, run_workers

    spec, args = case("qwen3_vl", max_seq_len=128)
    vl_folder(tmp_path / "hf", spec, args)
    one = _image_generation(0, 1, 0, tmp_path / "hf", chat)
    assert len({tuple(o) for o in one}) == 2 and all(len(set(o)) > 2 for o in one)
    two = run_workers(
        _image_generation, 2, tmp_path, free_port(), tmp_path / "hf", chat, init_pg=False
    )
    assert two[0] == two[1] == one
