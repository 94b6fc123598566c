"""GPT-OSS: published total and active sizes; its parts against their definitions (clamped
SwiGLU, untruncated YaRN, MXFP4); logits, generation and both HF directions (fused experts)
against transformers' GptOssForCausalLM with non-zero sinks and biases; every layout trains
like one process; resume is bitwise; what it cannot do is refused before launch."""

import sys
import warnings

import pytest
import torch

from tests.forked import built_model, run_trainer, tiny_run
from tests.layouts import layouts, one_rank_run
from tests.moe_checks import check_resume_is_bitwise, check_run_like_one_process
from tests.unit.test_qwen3 import check_save_pretrained_start
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.models.gpt_oss import mxfp4
from titan.models.gpt_oss.model import clamped_swiglu
from titan.models.gpt_oss.state_dict_adapter import gpt_oss_args_from_hf_config
from titan.models.spec import family_of_hf_config, get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

GPT_OSS = get_train_spec("gpt_oss")
DEBUG = GPT_OSS.flavors["debugmodel"].with_updates(max_seq_len=64)
STEPS = 10
COMMON = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel", *tiny_run(STEPS)]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]

# (total, active without the embedding) in billions as OpenAI's model card gives them (20.9
# and 3.6; 116.8 and 5.1), and titan's count to the card's rounding
PUBLISHED = {"20b": (20.9, 3.6, 0.05), "120b": (116.8, 5.1, 0.05)}


def built(args, seed=0, perturb: bool = False):
    """The model, with (`perturb`) its sinks and every bias random instead of zero, as a
    trained model's are: what makes them count in a comparison."""
    model = built_model(GPT_OSS, args, seed, eval=False)
    if perturb:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in model.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("sinks", "bias", "b1", "b2", "b3"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def tokens(batch=2, seq=None, seed=1):
    seq = seq or DEBUG.max_seq_len
    return torch.randint(
        0, DEBUG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_total_and_active_sizes(flavor):
    args = GPT_OSS.flavors[flavor]
    total, active, within = PUBLISHED[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=within)
    assert args.num_params(include_embedding=False, active=True) / 1e9 == pytest.approx(
        active, abs=within
    )
    small = args.with_updates(n_layers=2)
    assert sum(p.numel() for p in GPT_OSS.build_meta(small).parameters()) == small.num_params()


def test_debug_model_alternates_windows_and_holds_biases_and_sinks():
    model = built(DEBUG)
    assert model.sliding_windows == [16, None, 16, None]
    assert [b.attention.sliding_window for b in model.layers.values()] == [16, None, 16, None]
    block = model.layers["0"]
    assert block.attention.sinks.shape == (DEBUG.n_heads,)
    assert block.attention.wo.bias is not None and block.feed_forward.router.gate.bias is not None
    assert block.feed_forward.experts.b2.shape == (8, DEBUG.dim)
    # a sliding layer's window is shorter than the tests' sequences: it masks
    assert DEBUG.sliding_window < 32


def test_clamped_swiglu_is_the_definition():
    gate = torch.tensor([-10.0, -1.0, 0.5, 7.0, 9.0])
    up = torch.tensor([-9.0, 0.3, -2.0, 8.0, 1.0])
    g = torch.minimum(gate, torch.tensor(7.0))
    u = up.clamp(-7.0, 7.0)
    want = (u + 1) * g / (1 + torch.exp(-1.702 * g))
    torch.testing.assert_close(clamped_swiglu(gate, up, 7.0, 1.702), want)


@pytest.mark.needs("transformers")
def test_untruncated_yarn_equals_transformers():
    """The released rope (YaRN factor 32 over 4096 positions, truncate false) and its
    attention temperature, against transformers' own, at the 20b's head width."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from titan.models.gpt_oss.model import rope_cache

    args = GPT_OSS.flavors["20b"].with_updates(max_seq_len=4096)
    cfg = GptOssConfig(**GPT_OSS.state_dict_adapter(args).hf_config())
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    # the angles in float64, as titan takes them (transformers' float32 product is off by up
    # to 2e-4 at position 4000): what is compared is the frequencies and the temperature
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    table = rope_cache(args)
    torch.testing.assert_close(table[..., 0], (angles.cos() * scale).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table[..., 1], (angles.sin() * scale).float(), rtol=0, atol=1e-6)
    truncated = rope_cache(args.with_updates(rope_truncate=True))
    assert (truncated - table).abs().max() > 1e-3  # the rounding this flavor must not do


def test_hf_config_round_trip_and_refusals():
    for name, args in GPT_OSS.flavors.items():
        config = GPT_OSS.state_dict_adapter(args).hf_config()
        assert config["model_type"] == "gpt_oss" and family_of_hf_config(config) == "gpt_oss"
        assert GPT_OSS.matching_flavor(gpt_oss_args_from_hf_config(config, args.max_seq_len)) == (
            name
        )
    config = GPT_OSS.state_dict_adapter(DEBUG).hf_config()
    quantized = {**config, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match=r"python -m titan\.models\.gpt_oss\.mxfp4 SRC DST"):
        gpt_oss_args_from_hf_config(quantized)
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not"):
        gpt_oss_args_from_hf_config({**config, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(ValueError, match=r"top_k 9 must be between 1 and n_experts 8"):
        gpt_oss_args_from_hf_config({**config, "num_experts_per_tok": 9})


@pytest.mark.needs("transformers")
def test_logits_and_both_hf_directions_match_transformers(tmp_path):
    import transformers

    model = built(DEBUG, seed=3, perturb=True)
    out = hf_io.save_hf(model.state_dict(), GPT_OSS, DEBUG, tmp_path / "hf")
    names = hf_io.load_hf_state(out)
    assert names["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, DEBUG.dim, 2 * 128)
    assert "model.layers.0.self_attn.sinks" in names and "model.layers.0.mlp.router.bias" in names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    assert type(hf_model).__name__ == "GptOssForCausalLM"
    x = tokens()
    with torch.no_grad():
        logits = model(x)
        torch.testing.assert_close(logits, hf_model(x).logits, rtol=0, atol=1e-4)
        # the sinks, the windows and the biases each move the logits far beyond that bound
        for layer in model.layers.values():
            layer.attention.sinks.zero_()
        assert (model(x) - logits).abs().max() > 1e-2
        unwindowed = built(DEBUG.with_updates(sliding_window=10_000), seed=3, perturb=True)
        assert (unwindowed(x) - logits).abs().max() > 1e-2
    # and back, from what transformers writes (sharded)
    hf_model.save_pretrained(str(tmp_path / "from_hf"), max_shard_size="1MB")
    assert hf_io.args_from_hf(tmp_path / "from_hf", GPT_OSS, DEBUG.max_seq_len) == DEBUG
    back = hf_io.load_hf(tmp_path / "from_hf", GPT_OSS)
    state = built(DEBUG, seed=3, perturb=True).state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.needs("transformers")
def test_greedy_generation_equals_transformers(tmp_path):
    """With the cache, past the window: transformers' greedy tokens, one for one."""
    import transformers

    from titan.tools.generate import generate, load_model

    args = DEBUG
    hf_dir = hf_io.save_hf(built(args, seed=4, perturb=True).state_dict(), GPT_OSS, args, tmp_path)
    model, _ = load_model(hf_dir, None, GPT_OSS, 64, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    prompt = tokens(1, 11, seed=7)
    new = generate(model, [prompt[0].tolist()], max_new_tokens=30, eos_id=None)[0]
    want = hf_model.generate(
        prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 11:]
    assert new == want.tolist()
    # the sliding layers' cache holds their window - 1 latest keys, the full layers' all
    from titan.models.common.decode import DecodeCache

    cache = DecodeCache(max_len=64, pad=torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        model(prompt, cache=cache)
        for t in new[:10]:  # 21 tokens in all, past the window of 16
            model(torch.tensor([[t]]), cache=cache)
    assert [cache.kv[i][0].shape[1] for i in range(4)] == [15, 64, 15, 64]


def test_mxfp4_is_the_format_s_definition():
    # byte 0x2F: low nibble 0xF (-6.0) first, then 0x2 (1.0); scale 128: times 2
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F
    blocks[0, 0, 1] = 0x93  # 0x3 (1.5), 0x9 (-0.5)
    out = mxfp4.dequantize(blocks, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [-12.0, 2.0, 3.0, -1.0] and not out[0, 4:].any()


@pytest.mark.needs("transformers")
def test_mxfp4_dequantizes_as_transformers_does(tmp_path):
    """Random packed experts (4 experts, 6 output rows, 2 blocks of 32 inputs): titan's
    dequantization, in the hub's (experts, in, out) layout, equals transformers' bit for bit;
    a folder of them converts to one titan and transformers read alike."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (4, 6, 2), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales).transpose(-2, -1)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    # a debug model's folder with its experts' matrices in MXFP4
    args = DEBUG.with_updates(dim=64, moe=DEBUG.moe.__class__(n_experts=8, top_k=2, hidden_dim=32))
    src = hf_io.save_hf(built(args).state_dict(), GPT_OSS, args, tmp_path / "src")
    state = hf_io.load_hf_state(src)
    packed = {}
    for name, t in state.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            rows, cols = t.shape[2], t.shape[1]  # (experts, in, out) -> rows out, cols in
            packed[name + "_blocks"] = torch.randint(
                0, 256, (8, rows, cols // 32, 16), generator=g, dtype=torch.uint8
            )
            packed[name + "_scales"] = torch.randint(
                120, 128, (8, rows, cols // 32), generator=g, dtype=torch.uint8
            )
        else:
            packed[name] = t
    for f in src.glob("*.safetensors"):
        f.unlink()
    for f in src.glob("*.json"):
        if f.name != "config.json":
            f.unlink()
    save_file(packed, str(src / "model.safetensors"))
    mxfp4.main([str(src), str(tmp_path / "dst"), "--dtype", "float32"])
    back = hf_io.load_hf(tmp_path / "dst", GPT_OSS, args=args)
    w1 = back["layers.0.feed_forward.experts.w1"]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    gate_up = convert_moe_packed_tensors(
        packed[name + "_blocks"], packed[name + "_scales"], dtype=torch.float32
    )
    assert torch.equal(w1, gate_up[..., ::2].transpose(-2, -1))


def test_mxfp4_conversion_refuses_unpaired_and_occupied(tmp_path, capsys):
    with pytest.raises(ValueError, match="has no x_scales"):
        mxfp4.dequantize_state({"x_blocks": torch.zeros(1, 1, 16, dtype=torch.uint8)}, None)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep").write_text("data")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        mxfp4.main([str(tmp_path / "src"), str(tmp_path / "dst")])
    assert e.value.code == 2 and "is not empty" in capsys.readouterr().err
    assert (tmp_path / "dst" / "keep").read_text() == "data"


@pytest.mark.needs("transformers")
def test_a_save_pretrained_folder_starts_training_at_transformers_loss(tmp_path):
    def prepare(hf_model):  # transformers' init gives non-zero sinks and router biases
        with torch.no_grad():
            for name, p in hf_model.named_parameters():
                if name.endswith("_bias") or name.endswith(".bias"):
                    p.normal_(0, 0.5)

    check_save_pretrained_start(
        tmp_path, "GptOssConfig", "GptOssForCausalLM", DEBUG, family="gpt_oss", prepare=prepare
    )


one_rank = one_rank_run(*COMMON, *CKPT, steps=STEPS)


LAYOUTS = {
    # tp2:
    # heads, their biases and their sinks split over the ranks
    # cp2:
    # each rank's queries against every rank's keys (gathered), masked by position: the
    # window crosses the chunks, each row's softmax has its sink once
    **layouts("fsdp2", "hsdp2x2", "tp2", "pp2", "ep2", "cp2", "cp2_no_load_balance", "fsdp2_tp2"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_like_one_process(layout, one_rank, tmp_path):
    """Losses within 1e-5 (relative) of one process over 10 steps, the balancing loss on;
    routing is discrete, so this also says no token's k-th and (k+1)-th router logits came
    closer than the layouts' rounding (~1e-7)."""
    world, flags = LAYOUTS[layout]
    records = run_trainer(tmp_path, world, [*COMMON, *CKPT, *flags], deadline_s=150)
    check_run_like_one_process(
        one_rank, records, tmp_path / "dump", STEPS, moe_layers=0, layout=layout
    )
    # the sinks trained, and identically: each rank's share of the heads went home
    want = checkpoint.load_dcp_model_state(one_rank[1] / f"step-{STEPS}")
    got = checkpoint.load_dcp_model_state(tmp_path / "dump" / "checkpoint" / f"step-{STEPS}")
    for name in ("layers.0.attention.sinks", "layers.3.feed_forward.experts.b2"):
        assert want[name].abs().max() > 0
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5)


def test_resume_is_bitwise(one_rank, tmp_path):
    check_resume_is_bitwise(one_rank, tmp_path, [*COMMON, *CKPT], STEPS, at=5)


def test_balancing_loss_is_logged_apart(one_rank):
    first = one_rank[0][0]
    # balanced, each of 4 layers' losses is top_k = 2; at init they are close to it
    assert first["moe_aux_loss"] == pytest.approx(4 * 0.001 * 2, rel=0.05)


def test_the_20b_config_plans_as_its_comment_says():
    """train_configs/gpt_oss_20b.toml fits 80 GB on 8 ranks with balanced routing, at the
    total its comment gives (planned in a child process, as a user runs it)."""
    import json
    import re

    from titan.runtime.paths import REPO_ROOT

    config = REPO_ROOT / "train_configs" / "gpt_oss_20b.toml"
    text = config.read_text()
    said = float(re.search(r"transient: ([\d.]+) GiB of 80", text)[1])
    argv = ["--job.config_file", str(config), "--ngpu", "8", "--device-memory", "80GiB", "--json"]
    report = json.loads(_planned_json(argv))
    assert report["max_total_bytes"] / 2**30 == pytest.approx(said, abs=0.001)
    assert report["headroom_bytes"] > 0


def _planned_json(argv) -> str:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "titan.planner", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "ep2"])
def test_hf_export_and_load_from_sharded_layouts(layout, tmp_path):
    """Each rank writes and reads its rows of the fused expert tensors (FSDP, EP: whole
    experts) and its heads' sinks (TP); the folder and the reloaded model equal the
    one-process model."""
    from tests.moe_checks import check_hf_round_trip

    world, flags = LAYOUTS[layout]
    expected = built(DEBUG.with_updates(max_seq_len=32)).state_dict()
    check_hf_round_trip(tmp_path, world, [*COMMON, *flags], GPT_OSS, expected)


@pytest.mark.needs("transformers")
def test_a_trained_checkpoint_exports_to_transformers_with_titan_s_logits(one_rank, tmp_path):
    import transformers

    state = checkpoint.load_dcp_model_state(one_rank[1] / f"step-{STEPS}")
    args = DEBUG.with_updates(max_seq_len=32)
    model = built(args)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    out = hf_io.save_hf(model.state_dict(), GPT_OSS, args, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    x = tokens(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, rtol=0, atol=1e-4)
