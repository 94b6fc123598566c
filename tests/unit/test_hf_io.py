"""titan <-> HF / DCP weight I/O: exact round trips, the convert scripts, and HF numerics.

The HF reference forward below is written from transformers' modeling_llama.py
(rotate_half RoPE on HF-layout weights, repeat_kv GQA, LlamaRMSNorm, SwiGLU MLP, llama3
RoPE scaling) with plain torch ops on the HF state dict; it shares no code with titan.
"""

import importlib.util
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Transformer
from titan.models.llama3.state_dict_adapter import (
    Llama3StateDictAdapter,
    llama3_args_from_hf_config,
)
from titan.models.spec import get_train_spec

LLAMA = get_train_spec("llama3")

REPO = Path(__file__).resolve().parents[2]

# rope_original_max_len=32 with theta 1e4 and head_dim 16: wavelengths 6.3 (< 8: kept),
# 19.9 (8..32: blended) and >= 62.8 (> 32: divided by 8), so all three regimes matter
ARGS = Llama3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    multiple_of=32,
    rope_theta=10000.0,
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=32,
    max_seq_len=64,
)
PLAIN = ARGS.with_updates(rope_scaling_factor=None)


def build(args: Llama3Args, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        m = Transformer(args)
    m.to_empty(device="cpu")
    m.init_weights(seed=seed)
    # norms are all ones after init: make them matter; and sharpen attention (x8 on q and k)
    # so that RoPE, and the frequency scaling, move the logits well above the tolerance
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("wq.weight", "wk.weight")):
                p.mul_(8.0)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    return build(ARGS)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))


def assert_identical(a: dict, b: dict):
    assert set(a) == set(b)
    for k, t in a.items():
        assert t.dtype == b[k].dtype and t.shape == b[k].shape, k
        assert torch.equal(t, b[k]), k


# ----------------------------------------------------------------------------- HF folders


def test_hf_round_trip_bit_identical(model, tmp_path):
    sd = model.state_dict()
    out = hf_io.save_hf(sd, LLAMA, ARGS, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "titan_checksums.json",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["tie_word_embeddings"] is False and cfg["intermediate_size"] == ARGS.ffn_hidden_dim
    assert_identical(hf_io.load_hf(out, LLAMA), sd)
    # the file really is in HF layout: q permuted to halves, names HF's
    raw = hf_io.load_hf_state(out)
    assert torch.equal(
        raw["model.layers.1.self_attn.q_proj.weight"],
        Llama3StateDictAdapter(ARGS).to_hf(sd)["model.layers.1.self_attn.q_proj.weight"],
    )
    assert llama3_args_from_hf_config(cfg).ffn_hidden_dim == ARGS.ffn_hidden_dim


def test_hf_sharded_and_bf16(model, tmp_path):
    sd = model.state_dict()
    out = hf_io.save_hf(sd, LLAMA, ARGS, tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((out / hf_io.HF_INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / hf_io.HF_SINGLE_FILE).exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in sd.values())
    assert_identical(hf_io.load_hf(out, LLAMA), sd)
    # re-export into the same folder unsharded in bf16: old shards go, values are the bf16 cast
    hf_io.save_hf(sd, LLAMA, ARGS, out, dtype="bfloat16")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "titan_checksums.json",
    ]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_identical(hf_io.load_hf(out, LLAMA), {k: v.to(torch.bfloat16) for k, v in sd.items()})
    assert_identical(
        hf_io.load_hf(out, LLAMA, dtype="float32"),
        {k: v.to(torch.bfloat16).float() for k, v in sd.items()},
    )


def test_save_hf_rejects_wrong_state(model, tmp_path):
    sd = dict(model.state_dict())
    with pytest.raises(checkpoint.CheckpointError, match="shape mismatch"):
        hf_io.save_hf(sd, LLAMA, ARGS.with_updates(vocab_size=300), tmp_path / "hf")
    del sd["layers.1.feed_forward.w2.weight"]
    with pytest.raises(checkpoint.CheckpointError, match="missing"):
        hf_io.save_hf(sd, LLAMA, ARGS, tmp_path / "hf")


def test_tied_hf_model_loads_tied(model, tmp_path):
    """Llama 3.2 1B/3B ship tie_word_embeddings: the model built from such a config is tied,
    and an lm_head.weight some repos store anyway is ignored, as HF ignores it."""
    from safetensors.torch import save_file

    hf = Llama3StateDictAdapter(ARGS).to_hf(model.state_dict())
    hf["lm_head.weight"] = torch.zeros_like(hf["lm_head.weight"])
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))
    cfg = Llama3StateDictAdapter(ARGS).hf_config() | {"tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hf_io.args_from_hf(tmp_path, LLAMA).tie_word_embeddings
    state = hf_io.load_hf(tmp_path, LLAMA)
    assert state["output.weight"] is state["tok_embeddings.weight"]
    assert torch.equal(state["tok_embeddings.weight"], model.tok_embeddings.weight)


# ----------------------------------------------------------------------------- HF configs


@pytest.mark.parametrize("flavor", sorted(LLAMA3_FLAVORS))
def test_args_from_hf_config_recovers_flavors(flavor):
    args = LLAMA3_FLAVORS[flavor]
    cfg = Llama3StateDictAdapter(args).hf_config()
    # published long-context flavors export their context (Llama 3.1/3.2 ship 131072), the
    # debug model the length it was trained at
    assert cfg["max_position_embeddings"] == (
        args.max_seq_len if flavor.startswith("debug") else 131072
    )
    back = llama3_args_from_hf_config(cfg)
    assert back.with_updates(max_seq_len=args.max_seq_len) == args
    assert LLAMA.matching_flavor(back.with_updates(vocab_size=7, max_seq_len=9)) == flavor


def test_args_from_hf_config_variants():
    cfg = Llama3StateDictAdapter(ARGS).hf_config()
    # transformers 5 layout: rope_theta and the scaling live in rope_parameters
    v5 = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(cfg["rope_scaling"], rope_theta=cfg["rope_theta"])
    got = llama3_args_from_hf_config(v5, max_seq_len=16)
    assert got.rope_theta == ARGS.rope_theta and got.rope_original_max_len == 32
    assert got.rope_scaling_factor == 8.0 and got.max_seq_len == 16
    plain = llama3_args_from_hf_config(
        {**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    assert plain.rope_scaling_factor is None and plain.rope_theta == 1e4
    # Llama 3.2 1B style: widths that need ffn_dim_multiplier, no head_dim key
    odd = {k: v for k, v in cfg.items() if k != "head_dim"} | {"intermediate_size": 100}
    assert llama3_args_from_hf_config(odd).ffn_hidden_dim == 100
    bad = {
        "attention_bias": True,
        "hidden_act": "gelu",
        "head_dim": 32,
        "model_type": "mistral",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    for key, value in bad.items():
        c = {**cfg, key: value}
        # another model type is named as what it is (no titan family reads mistral)
        why = "unsupported HF config"
        if key == "model_type":
            c["architectures"] = ["MistralForCausalLM"]
            why = "holds a 'mistral' model, which no titan family reads"
        with pytest.raises(checkpoint.CheckpointError, match=why):
            hf_io.args_from_hf_config(LLAMA, c)


# ----------------------------------------------------------------------------- DCP


def test_dcp_model_only_round_trip(model, tmp_path):
    sd = model.state_dict()
    path = checkpoint.save_dcp_model_state(sd, tmp_path / "step-0")
    assert (path / checkpoint.COMPLETE_MARKER).is_file()
    assert_identical(checkpoint.load_dcp_model_state(path), sd)
    with pytest.raises(checkpoint.CheckpointError, match="not empty"):
        checkpoint.save_dcp_model_state(sd, path)
    bf = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    checkpoint.save_dcp_model_state(bf, path, overwrite=True)
    assert_identical(checkpoint.load_dcp_model_state(path), bf)
    (path / checkpoint.COMPLETE_MARKER).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not a completed checkpoint"):
        checkpoint.load_dcp_model_state(path)


def test_dcp_full_training_checkpoint(model, tmp_path):
    """Only the model entry is read from a checkpoint that also holds optimizer etc."""
    import torch.distributed.checkpoint as dcp

    sd = model.state_dict()
    full = {
        "model": dict(sd),
        "optimizer": {
            "state": {
                k: {"exp_avg": torch.zeros_like(v), "step": torch.tensor(3.0)}
                for k, v in list(sd.items())[:3]
            },
            "param_groups": [{"lr": 1e-3, "params": list(sd)[:3]}],
        },
        "lr_scheduler": {"last_epoch": 3},
        "train_state": {"step": 3},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(full, checkpoint_id=str(tmp_path / "checkpoint" / "step-3"), no_dist=True)
    with pytest.raises(checkpoint.CheckpointError, match="pass one step-N folder"):
        checkpoint.load_dcp_model_state(tmp_path / "checkpoint")
    (tmp_path / "checkpoint" / "step-3" / checkpoint.COMPLETE_MARKER).touch()
    assert_identical(checkpoint.load_dcp_model_state(tmp_path / "checkpoint" / "step-3"), sd)
    assert checkpoint.latest_complete_step(tmp_path / "checkpoint").name == "step-3"


# ----------------------------------------------------------------------------- scripts


def test_convert_scripts_end_to_end(tmp_path):
    root = tmp_path / "run" / "checkpoint"
    tok = REPO / "assets" / "tokenizer"

    # a registered flavor with this test's architecture, as a training config would name it
    flavor = "debugmodel"
    fargs = LLAMA3_FLAVORS[flavor].with_updates(vocab_size=64, max_seq_len=16)
    fsd = build(fargs, seed=4).state_dict()
    checkpoint.save_dcp_model_state(fsd, root / "step-10")
    (root / "step-20").mkdir()  # an interrupted save: no marker, must be skipped

    def run(*argv):
        return subprocess.run(
            [sys.executable, *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    hf_dir = tmp_path / "hf"
    r = run(
        "scripts/convert_to_hf.py",
        str(root),
        str(hf_dir),
        "--flavor",
        flavor,
        "--max-seq-len",
        "16",
        "--dtype",
        "float32",
        "--tokenizer",
        str(tok),
    )
    assert r.returncode == 0, r.stderr
    assert "step-10" in r.stdout
    assert "single process" not in r.stderr and "distributed is disabled" not in r.stderr
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    } <= {p.name for p in hf_dir.iterdir()}
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 64 and cfg["max_position_embeddings"] == 16
    # HF then stops generating at titan's EOS, not at its default id 2 (<|pad|> here)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    special = json.loads((hf_dir / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert_identical(hf_io.load_hf(hf_dir, LLAMA), fsd)

    dcp_dir = tmp_path / "dcp"
    r = run("scripts/convert_from_hf.py", str(hf_dir), str(dcp_dir))
    assert r.returncode == 0, r.stderr
    assert f"matches titan flavor '{flavor}'" in r.stdout
    assert_identical(checkpoint.load_dcp_model_state(dcp_dir), fsd)


def test_convert_to_hf_refuses_an_hf_folder_unless_overwrite(model, tmp_path, capsys):
    """A second export without --tokenizer used to leave the first one's tokenizer beside a
    config.json without BOS/EOS ids."""
    ckpt = checkpoint.save_dcp_model_state(model.state_dict(), tmp_path / "step-5")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(Llama3StateDictAdapter(ARGS).hf_config()))
    out = tmp_path / "hf"
    to_hf = _load_script("convert_to_hf").main
    argv = [str(ckpt), str(out), "--hf-config", str(config)]
    to_hf([*argv, "--tokenizer", str(REPO / "assets" / "tokenizer"), "--max-shard-size", "100KB"])
    (out / "README.md").write_text("mine")
    first = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "model.safetensors.index.json"} <= first
    capsys.readouterr()
    err = _exit_2(capsys, to_hf, argv)
    assert err.startswith(f"convert_to_hf: error: {out} already holds an HF model (config.json")
    assert err.rstrip().endswith("pass --overwrite to replace it, or choose another output folder")
    assert {p.name for p in out.iterdir()} == first  # untouched
    to_hf([*argv, "--overwrite"])
    assert "removed the earlier export" in capsys.readouterr().out
    # the tokenizer, the shards and their index are gone; what is not HF's stays
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "model.safetensors",
        "titan_checksums.json",
        "README.md",
    }
    assert "bos_token_id" not in json.loads((out / "config.json").read_text())
    assert_identical(hf_io.load_hf(out, LLAMA), model.state_dict())
    # a folder holding only other files is no export: no --overwrite needed
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    to_hf([str(ckpt), str(tmp_path / "plain"), "--hf-config", str(config)])


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exit_2(capsys, main, argv) -> str:
    """The one line a script prints on stderr when it refuses `argv` with exit code 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_convert_scripts_refuse_bad_input(tmp_path, capsys):
    (tmp_path / "step-1").mkdir()
    to_hf = _load_script("convert_to_hf").main
    assert "not a completed checkpoint" in _exit_2(
        capsys, to_hf, [str(tmp_path / "step-1"), str(tmp_path / "o"), "--flavor", "debugmodel"]
    )
    assert "unknown flavor" in _exit_2(
        capsys, to_hf, [str(tmp_path), str(tmp_path / "o"), "--flavor", "9B"]
    )
    from_hf = _load_script("convert_from_hf").main
    assert "no config.json" in _exit_2(capsys, from_hf, [str(tmp_path), str(tmp_path / "o")])
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    assert "config.json is not valid JSON (line 1: " in _exit_2(
        capsys, from_hf, [str(tmp_path), str(tmp_path / "o")]
    )
    # a step folder whose data file was cut short (a full disk, a copy interrupted)
    step = checkpoint.save_dcp_model_state({"w": torch.ones(4096)}, tmp_path / "ck" / "step-2")
    (data,) = step.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:1000])
    for given in (step, tmp_path / "ck"):
        err = _exit_2(capsys, to_hf, [str(given), str(tmp_path / "o"), "--flavor", "debugmodel"])
        assert "step-2" in err and ("is damaged" in err or "holds no intact step" in err), err


# ----------------------------------------------------------------------------- HF numerics


def hf_llama3_inv_freq(cfg: dict) -> torch.Tensor:
    """transformers' default / _compute_llama3_parameters inverse frequencies (float64)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq = 1.0 / (
        cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    )
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def hf_reference_logits(hf: dict, cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM.forward in float64 on an HF-named state dict."""
    sd = {k: v.double() for k, v in hf.items()}
    nh, nkv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg["hidden_size"] // nh
    bs, seq = tokens.shape
    freqs = torch.arange(seq, dtype=torch.float64)[:, None] * hf_llama3_inv_freq(cfg)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(bs, seq, nh, hd).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(bs, seq, nkv, hd).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(bs, seq, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
        attn = torch.softmax(q @ k.transpose(2, 3) * hd**-0.5 + mask, dim=-1)
        o = (attn @ v).transpose(1, 2).reshape(bs, seq, nh * hd)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms_norm(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


def test_scaling_exercises_all_regimes():
    wavelen = 2 * math.pi / hf_llama3_inv_freq(Llama3StateDictAdapter(PLAIN).hf_config())
    orig = ARGS.rope_original_max_len
    assert (wavelen < orig / ARGS.rope_high_freq_factor).any()
    assert (
        (wavelen > orig / ARGS.rope_high_freq_factor) & (wavelen < orig / ARGS.rope_low_freq_factor)
    ).any()
    assert (wavelen > orig / ARGS.rope_low_freq_factor).any()


@pytest.mark.parametrize("args", [ARGS, PLAIN], ids=["llama3_scaling", "plain_rope"])
def test_logits_match_hf_reference(args, tokens):
    m = build(args)
    with torch.no_grad():
        ours = m(tokens)
    hf = Llama3StateDictAdapter(args).to_hf(m.state_dict())
    cfg = Llama3StateDictAdapter(args).hf_config()
    ref = hf_reference_logits(hf, cfg, tokens)
    assert ours.shape == (*tokens.shape, args.vocab_size)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5)
    # controls: the other RoPE variant, and unpermuted q/k, are measurably different
    other = PLAIN if args is ARGS else ARGS
    wrong = hf_reference_logits(hf, Llama3StateDictAdapter(other).hf_config(), tokens)
    assert (wrong - ref).abs().max() > 1e-3
    unpermuted = dict(hf)
    for i in range(args.n_layers):
        for t, hn in (("wq", "q_proj"), ("wk", "k_proj")):
            unpermuted[f"model.layers.{i}.self_attn.{hn}.weight"] = m.state_dict()[
                f"layers.{i}.attention.{t}.weight"
            ]
    assert (hf_reference_logits(unpermuted, cfg, tokens) - ref).abs().max() > 1e-3


@pytest.mark.needs("transformers")
def test_transformers_loads_export(model, tokens, tmp_path):
    import transformers

    out = hf_io.save_hf(model.state_dict(), LLAMA, ARGS, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.LlamaForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        ours = model(tokens)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_bad_hf_folders_are_named(model, tmp_path):
    from safetensors.torch import save_file

    sd = model.state_dict()
    out = hf_io.save_hf(sd, LLAMA, ARGS, tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((out / hf_io.HF_INDEX_FILE).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (out / last).rename(tmp_path / last)
    with pytest.raises(checkpoint.CheckpointError, match=f"missing shards.*{last}"):
        hf_io.load_hf(out, LLAMA)

    hf = Llama3StateDictAdapter(ARGS).to_hf(sd)
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text((out / "config.json").read_text())
    gone = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(gone, str(single / "model.safetensors"))
    with pytest.raises(checkpoint.CheckpointError, match=r"missing \['layers.1.feed_forward.w3"):
        hf_io.load_hf(single, LLAMA)
    save_file(
        {
            **hf,
            "model.layers.0.mlp.gate_proj.weight": hf["model.layers.0.mlp.gate_proj.weight"].to(
                torch.int8
            ),
        },
        str(single / "model.safetensors"),
    )
    with pytest.raises(checkpoint.CheckpointError, match="torch.int8.*dequantize"):
        hf_io.load_hf(single, LLAMA)
    save_file(
        {**hf, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(single / "model.safetensors")
    )
    with pytest.raises(checkpoint.CheckpointError, match="unexpected HF parameter.*mlp.extra"):
        hf_io.load_hf(single, LLAMA)


def test_convert_to_hf_takes_an_hf_config_and_float16(model, tmp_path):
    ckpt = checkpoint.save_dcp_model_state(model.state_dict(), tmp_path / "step-5")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(Llama3StateDictAdapter(ARGS).hf_config()))
    _load_script("convert_to_hf").main(
        [str(ckpt), str(tmp_path / "o"), "--hf-config", str(config), "--dtype", "float16"]
    )
    assert json.loads((tmp_path / "o" / "config.json").read_text())["torch_dtype"] == "float16"
    assert_identical(
        hf_io.load_hf(tmp_path / "o", LLAMA), {k: v.half() for k, v in model.state_dict().items()}
    )


def test_an_hf_folder_of_another_family_names_it():
    """An HF config the family cannot read says what it holds: the family that reads it, or
    that none does and the model types each family reads."""
    from titan.components.checkpoint.folders import CheckpointError
    from titan.components.checkpoint.hf_io import args_from_hf_config
    from titan.models.spec import get_train_spec

    llama = get_train_spec("llama3")
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(CheckpointError, match="holds a 'qwen3' model, .* model.name = 'qwen3'"):
        args_from_hf_config(llama, {**config, "model_type": "qwen3"})
    with pytest.raises(CheckpointError, match="'gemma3_text' model, which no titan family reads"):
        args_from_hf_config(llama, {**config, "model_type": "gemma3_text"})


def test_convert_to_hf_reads_what_a_training_checkpoint_records(tmp_path, capsys):
    """A training checkpoint records its model and tokenizer: --flavor naming another is
    refused in one line that names the checkpoint's, and the export carries the tokenizer
    the run trained with."""
    from tests.forked import run_trainer, tiny_run

    ck = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    run_trainer(tmp_path / "run", 1, [*tiny_run(2), *ck], dump=tmp_path / "dump")
    step = tmp_path / "dump" / "checkpoint" / "step-2"
    to_hf = _load_script("convert_to_hf").main
    err = _exit_2(capsys, to_hf, [str(step), str(tmp_path / "wrong"), "--flavor", "8B"])
    assert "holds a llama3 debugmodel model, not 8B: drop --flavor" in err
    to_hf([str(step), str(tmp_path / "hf")])
    assert {"tokenizer.json", "special_tokens_map.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] is not None and config["eos_token_id"] is not None
